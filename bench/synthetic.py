"""Synthetic inputs of the benchmark: tiled GeoTIFFs of any size, a RetinaNet model file, a million detections.

Rasters are written block by block (deflate, 512 px blocks) from a textured block, so that a 16k or 32k raster
costs seconds; with ``only`` given, just the blocks under those windows are written and the rest of the file
stays sparse (GDAL reads it as zeros), which makes a 32k x 32k x 3 raster (3 GB of pixels) a few MB on disk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
import rasterio
import torch
from affine import Affine
from rasterio.windows import Window

from rasterscale.grid.manifest import build_manifest, write_manifest
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.geo import box_areas, pixel_boxes_to_polygons
from rasterscale.raster.imagery import resolve_spec
from rasterscale.tasks.detection.model import DetectorConfig, build_detector, save_detector
from rasterscale.tasks.instances.model import build_instance_model, save_instance_model
from rasterscale.tasks.instances.modelfiles import InstanceConfig

CRS = "EPSG:32617"
TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
BLOCK = 512


def texture(block: int = BLOCK, seed: int = 0) -> np.ndarray:
    """A (3, block, block) uint8 block: smooth gradients plus fine noise, roughly as compressible as imagery."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(40, 200, block, dtype=np.float32)
    base = ramp[None, :, None] * 0.5 + ramp[None, None, :] * 0.5 + rng.normal(0, 12, (3, block, block))
    return np.clip(base, 0, 255).astype(np.uint8)


def blocks_under(windows: Sequence[Window], block: int = BLOCK) -> set[tuple[int, int]]:
    """(row, col) indices of the blocks that the windows touch."""
    touched = set()
    for w in windows:
        for r in range(int(w.row_off) // block, math.ceil((w.row_off + w.height) / block)):
            for c in range(int(w.col_off) // block, math.ceil((w.col_off + w.width) / block)):
                touched.add((r, c))
    return touched


def write_raster(path: Path, side: int, only: Sequence[Window] | None = None, block: int = BLOCK) -> Path:
    """A side x side RGB tiled GeoTIFF; every block written, or (``only``) just those under the windows."""
    pattern = texture(block)
    n = math.ceil(side / block)
    wanted = blocks_under(only, block) if only is not None else {(r, c) for r in range(n) for c in range(n)}
    profile = {
        "driver": "GTiff",
        "width": side,
        "height": side,
        "count": 3,
        "dtype": "uint8",
        "crs": CRS,
        "transform": TRANSFORM,
        "tiled": True,
        "blockxsize": block,
        "blockysize": block,
        "compress": "deflate",
        "zlevel": 1,
        "bigtiff": "if_safer",
        "sparse_ok": True,
        "num_threads": "all_cpus",
    }
    with rasterio.open(path, "w", **profile) as dst:
        for r, c in sorted(wanted):
            window = Window(c * block, r * block, min(block, side - c * block), min(block, side - r * block))
            shifted = np.roll(pattern, (r * 31 + c * 17) % block, axis=2)
            dst.write(shifted[:, : window.height, : window.width], window=window)
    return path


def write_scene(workdir: Path, side: int, patch: int, overlap: int) -> tuple[Path, Path, gpd.GeoDataFrame]:
    """A side x side scene (:func:`write_raster`) and its tile manifest of ``patch`` px tiles, in ``workdir``: the
    raster, the manifest file and its frame."""
    raster = write_raster(workdir / "scene.tif", side)
    manifest = workdir / "tiles.parquet"
    frame = build_manifest(raster, patch, overlap)
    write_manifest(frame, resolve_spec(raster), TileGrid(patch, overlap), manifest)
    return raster, manifest, frame


def tile_windows(tiles: Sequence[Tile]) -> list[Window]:
    return [Window(t.col_off, t.row_off, t.width, t.height) for t in tiles]


def write_detector(
    path: Path,
    backbone: str = "resnet50",
    patch_size: int = 400,
    seed: int = 0,
    resize: tuple[int, int] | None = None,
) -> Path:
    """An untrained (seeded) detector model file: timings do not depend on the weights' values. ``resize``: the
    model's input scale (``DetectorConfig.resize``; None: native)."""
    torch.manual_seed(seed)
    detector = DetectorConfig(backbone=backbone, patch_size=patch_size, resize=resize)
    save_detector(build_detector(detector), detector, path)
    return path


def write_instance_model(
    path: Path,
    backbone: str = "resnet50",
    patch_size: int = 400,
    seed: int = 0,
    resize: tuple[int, int] | None = None,
) -> Path:
    """An untrained (seeded) Mask R-CNN model file (``instances``) of DeepForest's architecture and ``resize``:
    untrained, its class scores all near a third, so that every tile reaches its cap of instances (the heaviest
    mask work a tile can ask)."""
    torch.manual_seed(seed)
    cfg = InstanceConfig(backbone=backbone, patch_size=patch_size, resize=resize)
    save_instance_model(build_instance_model(cfg), cfg, path)
    return path


def overlapping_detections(manifest: gpd.GeoDataFrame, side: int, n_objects: int, seed: int = 0) -> gpd.GeoDataFrame:
    """Detections as prediction ranks write them, for a full row-major tile grid: objects (6-40 px) spread over
    the raster, each seen by every tile that holds at least half of it, clipped to that tile and jittered, so
    that tile overlaps produce duplicates and cut boxes as real ones do."""
    rng = np.random.default_rng(seed)
    size = rng.uniform(6, 40, (n_objects, 2))
    x0, y0 = rng.uniform(0, side - size[:, 0]), rng.uniform(0, side - size[:, 1])
    objects = np.stack([x0, y0, x0 + size[:, 0], y0 + size[:, 1]], axis=1)
    windows = manifest[["col_off", "row_off", "width", "height"]].to_numpy()
    cols, rows = np.unique(windows[:, 0]), np.unique(windows[:, 1])
    width, height = int(windows[0, 2]), int(windows[0, 3])
    # tiles [lo, hi) along each axis hold part of the object; an object meets at most 3 tiles per axis
    c_lo, c_hi = np.searchsorted(cols + width, objects[:, 0], "right"), np.searchsorted(cols, objects[:, 2])
    r_lo, r_hi = np.searchsorted(rows + height, objects[:, 1], "right"), np.searchsorted(rows, objects[:, 3])
    seen_obj, seen_tile = [], []
    for dc in range(3):
        for dr in range(3):
            c, r = c_lo + dc, r_lo + dr
            idx = np.flatnonzero((c < c_hi) & (r < r_hi))
            seen_obj.append(idx)
            seen_tile.append(r[idx] * len(cols) + c[idx])  # tile_id of a row-major grid
    obj, tile = np.concatenate(seen_obj), np.concatenate(seen_tile)
    w = windows[tile]
    clipped = np.stack(
        [
            np.maximum(objects[obj, 0], w[:, 0]),
            np.maximum(objects[obj, 1], w[:, 1]),
            np.minimum(objects[obj, 2], w[:, 0] + w[:, 2]),
            np.minimum(objects[obj, 3], w[:, 1] + w[:, 3]),
        ],
        axis=1,
    )
    keep = box_areas(clipped) >= 0.5 * box_areas(objects[obj])
    boxes = clipped[keep] + rng.normal(0, 0.7, (int(keep.sum()), 4))
    frame = pd.DataFrame(
        {
            "tile_id": tile[keep],
            "label": "tree",
            "score": rng.uniform(0.3, 1.0, len(boxes)).astype(np.float32),
            "px_xmin": boxes[:, 0],
            "px_ymin": boxes[:, 1],
            "px_xmax": boxes[:, 2],
            "px_ymax": boxes[:, 3],
        }
    )
    return gpd.GeoDataFrame(frame, geometry=pixel_boxes_to_polygons(boxes, TRANSFORM), crs=CRS)
