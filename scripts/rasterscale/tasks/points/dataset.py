"""The points task's training samples: tiles of a scene with their heatmap targets, a Gaussian of ``sigma`` around
each true point (:func:`gaussian_heatmap`), NaN (left out of the loss) where the imagery is masked; the true points
of each tile are kept for validation's scores."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.raster.windows import tile_window
from rasterscale.tasks.dense import DenseTileDataset
from rasterscale.tasks.points.groundtruth import PointTruth

REACH_SIGMAS = 3  # a Gaussian is drawn out to this many sigmas


def gaussian_heatmap(
    xy: np.ndarray, labels: np.ndarray, classes: int, height: int, width: int, sigma_px: float
) -> np.ndarray:
    """(K, H, W) float32 targets of a tile: for each point at pixel coordinates ``xy`` (column, row; a pixel's
    centre at +0.5) of class ``labels``, a Gaussian of ``sigma_px``, exactly 1 at the pixel holding it; the
    maximum where they overlap. Points up to 3 sigma outside the tile still reach into it."""
    heat = np.zeros((classes, height, width), dtype=np.float32)
    reach = max(1, math.ceil(REACH_SIGMAS * sigma_px))
    for (x, y), label in zip(np.asarray(xy, dtype=np.float64).reshape(-1, 2), labels, strict=True):
        col, row = math.floor(x), math.floor(y)
        c0, c1 = max(0, col - reach), min(width, col + reach + 1)
        r0, r1 = max(0, row - reach), min(height, row + reach + 1)
        if c0 >= c1 or r0 >= r1:
            continue
        dx = np.arange(c0, c1) + 0.5 - x
        dy = np.arange(r0, r1) + 0.5 - y
        blob = np.exp(-(dy[:, None] ** 2 + dx[None, :] ** 2) / (2 * sigma_px**2)).astype(np.float32)
        if 0 <= row < height and 0 <= col < width:
            blob[row - r0, col - c0] = 1.0
        target = heat[int(label), r0:r1, c0:c1]
        np.maximum(target, blob, out=target)
    return heat


class PointTileDataset(DenseTileDataset):
    """Training tiles with their heatmaps: item -> (float image (B, h, w), float32 heatmap (K, h, w)), NaN where
    the imagery is masked. ``truth``: the scene's points in its raster's pixels; ``sigma_px``: the Gaussian's sigma
    in pixels of this raster."""

    def __init__(
        self,
        raster_path: str | Path,
        tiles: Sequence[Tile],
        spec: ImageSpec,
        truth: PointTruth,
        classes: int,
        sigma_px: float,
    ) -> None:
        super().__init__(raster_path, tiles, spec)
        self.truth, self.classes, self.sigma_px = truth, classes, sigma_px

    def points_of(self, tile: Tile, margin: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """The true points within ``margin`` px of the tile, in its pixels (column, row), and their classes."""
        x, y = self.truth.xy[:, 0] - tile.col_off, self.truth.xy[:, 1] - tile.row_off
        near = (x >= -margin) & (y >= -margin) & (x < tile.width + margin) & (y < tile.height + margin)
        return np.column_stack([x[near], y[near]]), self.truth.labels[near]

    def targets_of(self, tile: Tile) -> torch.Tensor:
        xy, labels = self.points_of(tile, REACH_SIGMAS * self.sigma_px + 1)
        heat = gaussian_heatmap(xy, labels, self.classes, tile.height, tile.width, self.sigma_px)
        return torch.from_numpy(self.masked(tile_window(tile), heat, np.nan))
