"""Tile manifests: the windows that cut a raster into overlapping patches, with their footprints in the CRS.

A manifest is computed from the raster's metadata (size and transform), and, for rasters that mark invalid
pixels, from a decimated read of their mask: tiles wholly masked are left out. Offsets step by
``patch_size - overlap``; the last row and column of tiles are flush with the raster's edge, so every pixel is
covered and no tile reads past the raster. The scene's :class:`~rasterscale.raster.imagery.ImageSpec` and its
:class:`TileGrid` (patch size and overlap) travel in the manifest's parquet metadata (:func:`write_manifest`,
:func:`rasterscale.raster.imagery.read_spec`, :func:`read_grid`): jobs take them from there, never from the config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import geopandas as gpd
import numpy as np
import pyarrow.parquet as pq
import rasterio
import shapely
from affine import Affine
from geopandas.io.arrow import _geopandas_to_arrow
from rasterio.crs import CRS

from rasterscale.atomic import atomic_path
from rasterscale.grid.project import Footprint, Seam, tile_region, tile_regions
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.geo import pixel_boxes_to_polygons
from rasterscale.raster.headers import DEFAULT_BANDS, raster_info
from rasterscale.raster.imagery import SPEC_KEY, ImageSpec, manifest_entry, mask_of, valid_mask
from rasterscale.raster.remote import open_raster

MANIFEST_COLUMNS = ["tile_id", "col_off", "row_off", "width", "height", "geometry"]
GRID_KEY = b"rasterscale:grid"


def tile_offsets(length: int, patch_size: int, overlap: int) -> list[int]:
    """Start offsets along one axis: stride ``patch_size - overlap``, last tile flush with the edge."""
    if overlap >= patch_size:
        raise ValueError(f"overlap ({overlap}) must be smaller than patch_size ({patch_size})")
    if length <= patch_size:
        return [0]
    stride = patch_size - overlap
    count = math.ceil((length - patch_size) / stride) + 1
    offsets = [i * stride for i in range(count - 1)]
    offsets.append(length - patch_size)
    return offsets


def tile_count(width: int, height: int, patch_size: int, overlap: int) -> int:
    """The tiles :func:`tile_grid` lays over a raster of this size: its manifest's count when no tile is masked."""
    return len(tile_offsets(width, patch_size, overlap)) * len(tile_offsets(height, patch_size, overlap))


def tile_grid(width: int, height: int, patch_size: int, overlap: int) -> np.ndarray:
    """``(N, 4)`` int array of col_off, row_off, width, height in row-major order."""
    cols = tile_offsets(width, patch_size, overlap)
    rows = tile_offsets(height, patch_size, overlap)
    col_grid, row_grid = np.meshgrid(np.asarray(cols, dtype=np.int64), np.asarray(rows, dtype=np.int64))
    col_off, row_off = col_grid.ravel(), row_grid.ravel()
    tile_w = np.full_like(col_off, min(patch_size, width))
    tile_h = np.full_like(row_off, min(patch_size, height))
    return np.stack([col_off, row_off, tile_w, tile_h], axis=1)


def manifest_frame(grid: np.ndarray, transform: Affine, crs: CRS | str | None) -> gpd.GeoDataFrame:
    """A manifest GeoDataFrame from a tile grid (tile_id numbers the tiles in row-major order)."""
    col_off, row_off, width, height = (grid[:, k] for k in range(4))
    boxes = np.stack([col_off, row_off, col_off + width, row_off + height], axis=1)
    return gpd.GeoDataFrame(
        {
            "tile_id": np.arange(len(grid), dtype=np.int64),
            "col_off": col_off,
            "row_off": row_off,
            "width": width,
            "height": height,
        },
        geometry=pixel_boxes_to_polygons(boxes, transform),
        crs=crs,
    )


def valid_tile_mask(
    src: rasterio.io.DatasetReader, grid: np.ndarray, spec: ImageSpec, max_side: int = 2048
) -> np.ndarray:
    """True for tiles that hold at least one valid pixel, judged on a reduced-resolution mask (the spec's:
    alpha, nodata or the dataset's mask).

    The mask is read decimated (GDAL uses overviews where present) and each tile's window is grown by one
    cell, so that a tile is only dropped when it is certainly all masked.
    """
    scale = max(1, math.ceil(max(src.width, src.height) / max_side))
    out_shape = (max(1, math.ceil(src.height / scale)), max(1, math.ceil(src.width / scale)))
    mask = valid_mask(src, spec, out_shape=out_shape)
    if mask is None:
        return np.ones(len(grid), dtype=bool)
    keep = np.zeros(len(grid), dtype=bool)
    for k, (col, row, width, height) in enumerate(grid):
        c0, r0 = max(0, col // scale - 1), max(0, row // scale - 1)
        c1, r1 = math.ceil((col + width) / scale) + 1, math.ceil((row + height) / scale) + 1
        keep[k] = bool(mask[r0:r1, c0:c1].any())
    return keep


def tiles_meeting(grid: np.ndarray, transform: Affine, region: shapely.Geometry) -> np.ndarray:
    """True for the tiles of ``grid`` whose footprint meets ``region`` (in the raster's CRS)."""
    col_off, row_off, width, height = (grid[:, k] for k in range(4))
    boxes = np.stack([col_off, row_off, col_off + width, row_off + height], axis=1)
    return np.asarray(shapely.intersects(pixel_boxes_to_polygons(boxes, transform), region), dtype=bool)


def seam_tile_counts(
    seams: Sequence[Seam], footprints: Mapping[str, Footprint], patch_size: int, overlap: int
) -> list[int]:
    """At most the tiles of each seam's manifest (:func:`build_manifest` of its mosaic with its core, no tile masked),
    from its scenes' footprints, all seams at once: the tiles of the mosaic's grid whose footprint meets the bounding
    box of the seam's tile region (touching counts, as for shapely's ``intersects``). That is its count where the
    region is a rectangle (scenes that abut), and an upper bound otherwise. The mosaic is
    :func:`rasterscale.raster.mosaic.mosaic_xml`'s (the union of the two scenes' bounds at the first one's pixel size,
    north-up), its tiles' corners computed as :func:`rasterscale.raster.geo.pixel_boxes_to_polygons` computes them."""
    if not seams:
        return []
    pixel = np.array([footprints[seam.a].pixel for seam in seams])
    first = np.array([footprints[seam.a].bounds for seam in seams])
    second = np.array([footprints[seam.b].bounds for seam in seams])
    lows, highs = np.minimum(first, second), np.maximum(first, second)
    left, bottom, right, top = lows[:, 0], lows[:, 1], highs[:, 2], highs[:, 3]
    widths = np.rint((right - left) / pixel[:, 0]).astype(np.int64)
    heights = np.rint((top - bottom) / pixel[:, 1]).astype(np.int64)
    region = region_bounds([seam.core for seam in seams], overlap * pixel.max(axis=1))
    counts = np.zeros(len(seams), dtype=np.int64)
    for width, height in set(zip(widths.tolist(), heights.tolist(), strict=True)):
        k = np.flatnonzero((widths == width) & (heights == height))
        cols = axis_tiles(width, patch_size, overlap, pixel[k, 0], left[k], region[k, 0], region[k, 2])
        rows = axis_tiles(height, patch_size, overlap, -pixel[k, 1], top[k], region[k, 1], region[k, 3])
        counts[k] = cols * rows
    return counts.tolist()


def axis_tiles(
    length: int, patch_size: int, overlap: int, scale: np.ndarray, origin: np.ndarray, low: np.ndarray, high: np.ndarray
) -> np.ndarray:
    """Along one axis of rasters ``length`` px long, for each raster (its pixel ``scale`` and ``origin`` in CRS units),
    how many of :func:`tile_offsets`' tiles reach into [``low``, ``high``]."""
    offsets = np.asarray(tile_offsets(length, patch_size, overlap), dtype=np.float64)
    starts = scale[:, None] * offsets + origin[:, None]
    ends = scale[:, None] * (offsets + min(patch_size, length)) + origin[:, None]
    reach = (np.maximum(starts, ends) >= low[:, None]) & (np.minimum(starts, ends) <= high[:, None])
    return np.count_nonzero(reach, axis=1)


def region_bounds(cores: Sequence[str], margins: np.ndarray) -> np.ndarray:
    """The bounds of :func:`rasterscale.grid.project.tile_regions`. A rectilinear core's (every edge along an axis, as
    the cores of scenes' axis-aligned footprints are) are its own widened by the margin, which its mitred buffer's
    are exactly; only the others are buffered."""
    geometries = shapely.from_wkt(np.asarray(cores, dtype=object))
    widened = shapely.bounds(geometries) + margins[:, None] * np.array([-1.0, -1.0, 1.0, 1.0])
    coordinates, index = shapely.get_coordinates(geometries, return_index=True)
    step = np.diff(coordinates, axis=0)
    slanted = (index[1:] == index[:-1]) & (step[:, 0] != 0) & (step[:, 1] != 0)  # (or from one ring to the next)
    others = np.unique(index[1:][slanted])
    if len(others):
        widened[others] = shapely.bounds(tile_regions([cores[k] for k in others], margins[others]))
    return widened


def build_manifest(
    raster_path: str | Path,
    patch_size: int,
    overlap: int,
    skip_nodata: bool = True,
    spec: ImageSpec | None = None,
    core: str = "",
) -> gpd.GeoDataFrame:
    """The tile manifest of a raster; tiles that are certainly all masked (by ``spec``'s mask; default: the
    raster's own, bands 1-3) are left out when asked. Rasters without a mask are not read. A seam's ``core``
    (WKT): only the tiles near it (:func:`rasterscale.grid.project.tile_region`, ``overlap`` px around it)."""
    with open_raster(raster_path) as src:
        spec = spec or ImageSpec(DEFAULT_BANDS, *mask_of(raster_info(src)))
        grid = tile_grid(src.width, src.height, patch_size, overlap)
        if core:
            pixel = max(abs(src.transform.a), abs(src.transform.e))
            grid = grid[tiles_meeting(grid, src.transform, tile_region(core, overlap * pixel))]
        if skip_nodata and spec.mask != "none":
            grid = grid[valid_tile_mask(src, grid, spec)]
        return manifest_frame(grid, src.transform, src.crs)


def write_manifest(frame: gpd.GeoDataFrame, spec: ImageSpec, grid: TileGrid, path: str | Path) -> None:
    """Write a manifest as GeoParquet with the scene's imagery spec and tile grid in its metadata, atomically."""
    table = _geopandas_to_arrow(frame, index=False)  # what GeoDataFrame.to_parquet writes, "geo" metadata included
    ours = {SPEC_KEY: spec.to_json().encode(), GRID_KEY: json.dumps(asdict(grid)).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **ours})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def tiles_from_frame(frame: gpd.GeoDataFrame) -> list[Tile]:
    columns = ["tile_id", "col_off", "row_off", "width", "height"]
    return [Tile(*map(int, row)) for row in frame[columns].itertuples(index=False)]


def read_manifest(path: str | Path) -> gpd.GeoDataFrame:
    return gpd.read_parquet(path)


def read_grid(manifest_path: str | Path) -> TileGrid:
    """The tile grid a manifest was cut with (stored by the tiles rule)."""
    entry = manifest_entry(manifest_path, GRID_KEY, "tile grid", "delete it and run again")  # an older one's
    return TileGrid(**json.loads(entry))
