"""Synthetic segmentation predictions for the blend and merge tests, no model needed.

A known class map (discs and rectangles on background), a scene raster with a no-data region, and per-tile
"probabilities" made from the class map plus noise and a class bias that are worst near the tile's inner edges
(where a model sees least context). A tile's probabilities depend on the tile alone, not on the rank predicting
it, as a model's do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from conftest import write_raster
from rasterscale.grid.sharding import rank_tiles
from rasterscale.grid.tile import Tile
from rasterscale.tasks.segmentation.blend import BLEND_MB, TileBlender, halo_tiles, tile_cores

NUM_CLASSES = 3


def class_map(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 classes: 0 background, 1 discs, 2 rectangles."""
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:height, 0:width]
    truth = np.zeros((height, width), dtype=np.uint8)
    for _ in range(max(1, width * height // 40_000)):
        x0, y0 = rng.integers(0, width - 80), rng.integers(0, height - 60)
        truth[y0 : y0 + rng.integers(20, 60), x0 : x0 + rng.integers(20, 80)] = 2
    for _ in range(max(1, width * height // 25_000)):
        cx, cy, radius = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, 45)
        truth[(cols - cx) ** 2 + (rows - cy) ** 2 < radius**2] = 1
    return truth


def inner_edge_distance(tile: Tile, width: int, height: int) -> np.ndarray:
    """(h, w) distance in px from each pixel's centre to the tile's nearest inner edge (inf: none)."""
    rows = np.arange(tile.height) + 0.5
    cols = np.arange(tile.width) + 0.5
    d_row = np.minimum(
        rows if tile.row_off > 0 else np.inf, tile.height - rows if tile.row_off + tile.height < height else np.inf
    )
    d_col = np.minimum(
        cols if tile.col_off > 0 else np.inf, tile.width - cols if tile.col_off + tile.width < width else np.inf
    )
    return np.minimum(d_row[:, None], d_col[None, :])


def tile_probabilities(tile: Tile, truth: np.ndarray, seed: int = 0) -> np.ndarray:
    """(C, h, w) float32 softmax of the true class's one-hot plus per-pixel noise and a per-tile class bias, both
    growing towards the tile's inner edges; seeded by the tile alone."""
    height, width = truth.shape
    rng = np.random.default_rng([seed, tile.tile_id])
    window = truth[tile.row_off : tile.row_off + tile.height, tile.col_off : tile.col_off + tile.width]
    near_edge = np.exp(-inner_edge_distance(tile, width, height) / 24.0).astype(np.float32)
    logits = 2.0 * (np.arange(NUM_CLASSES)[:, None, None] == window[None]).astype(np.float32)
    logits += rng.normal(size=logits.shape).astype(np.float32) * (0.6 + 3.0 * near_edge)
    logits += rng.normal(size=(NUM_CLASSES, 1, 1)).astype(np.float32) * 2.0 * near_edge
    logits -= logits.max(axis=0, keepdims=True)
    probs = np.exp(logits)
    return (probs / probs.sum(axis=0, keepdims=True)).astype(np.float32)


def scene_with_hole(path: Path, width: int, height: int, hole_cols: tuple[int, int]) -> Path:
    """A uint8 RGB scene, nodata 0: no data in the top-left corner and in a full-height band of columns
    ``hole_cols`` (wide enough that a whole column of tiles is left out of the manifest)."""
    data = np.random.default_rng(1).integers(1, 255, size=(3, height, width), dtype=np.uint8)
    data[:, : height // 3, : width // 3] = 0
    data[:, :, hole_cols[0] : hole_cols[1]] = 0
    return write_raster(path, width, height, nodata=0, data=data)


def split_contiguous(tiles: list[Tile], parts: int, shards: int = 1) -> list[list[int]]:
    """Each rank's own tile ids, the manifest order split as jobs split it (:func:`rank_tiles`): ``shards`` shards of
    ``parts`` ranks each, rank after rank."""
    ids = [t.tile_id for t in tiles]
    return [rank_tiles(ids, shards, shard, parts, rank) for shard in range(shards) for rank in range(parts)]


def predict_ranks(
    tiles: list[Tile],
    truth: np.ndarray,
    taper: int,
    out_dir: Path,
    ranks: int,
    transform: object,
    crs: object,
    probabilities: bool = False,
    blend_mb: float = BLEND_MB,
    shards: int = 1,
    batch: int = 7,
) -> list[Path]:
    """Each rank (of each shard) blends its own and halo tiles into its own rank raster, ``batch`` tiles at a time,
    as a prediction rank feeds them; the rank rasters' paths."""
    height, width = truth.shape
    cores = tile_cores(tiles, width, height)
    paths = []
    for rank, own in enumerate(split_contiguous(tiles, ranks, shards)):
        path = out_dir / f"rank-{rank}.tif"
        todo = halo_tiles(tiles, own, cores)
        blender = TileBlender(
            todo,
            set(own),
            cores,
            width,
            height,
            NUM_CLASSES,
            taper,
            path,
            transform,
            crs,
            probabilities,
            blend_mb=blend_mb,
        )
        for start in range(0, len(todo), batch):
            chunk = todo[start : start + batch]
            values = np.stack([tile_probabilities(tile, truth) for tile in chunk])
            blender.add_batch([tile.tile_id for tile in chunk], torch.from_numpy(values))
        assert blender.close() == sorted(own)
        paths.append(path)
    return paths
