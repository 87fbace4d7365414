"""Regression's training samples: tiles of a scene with their target values
(:mod:`rasterscale.tasks.regression.groundtruth`), and the targets' scale measured on them (:func:`target_scale`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from rasterscale.errors import InputError
from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.raster.windows import tile_window
from rasterscale.tasks.dense import DenseTileDataset
from rasterscale.tasks.regression.groundtruth import TargetRaster

SCALE_TILES = 64  # tiles (spread over the training tiles) the targets' scale is measured on
SCALE_STEP = 4  # every 4th pixel of them, along each axis


class RegressionTileDataset(DenseTileDataset):
    """Training tiles with their targets: item -> (float image (B, h, w), float32 targets (K, h, w)).

    Targets are NaN (left out of the loss) where the target raster has no data or the imagery is masked (the spec's
    mask). ``sample``: the same, image and targets flipped together (training's augmentation:
    :mod:`rasterscale.datasets.sampling`).
    """

    def __init__(self, raster_path: str | Path, tiles: Sequence[Tile], spec: ImageSpec, targets: TargetRaster) -> None:
        super().__init__(raster_path, tiles, spec)
        self.targets = targets

    def values(self, tile: Tile) -> np.ndarray:
        """The tile's targets (K, h, w) float32, NaN where there is none or the imagery is masked."""
        window = tile_window(tile)
        return self.masked(window, self.targets.read(window), np.nan)

    def targets_of(self, tile: Tile) -> torch.Tensor:
        return torch.from_numpy(self.values(tile))

    def target_moments(self, most: int = SCALE_TILES, step: int = SCALE_STEP) -> np.ndarray:
        """(3, K) float64: the count, sum and sum of squares of the targets of up to ``most`` tiles spread over the
        dataset (every ``step``-th pixel of each)."""
        moments = np.zeros((3, self.targets.count), dtype=np.float64)
        if not self.tiles:
            return moments
        picks = np.unique(np.linspace(0, len(self.tiles) - 1, min(most, len(self.tiles))).round().astype(int))
        for index in picks:
            values = self.values(self.tiles[index])[:, ::step, ::step].astype(np.float64)
            known = np.isfinite(values)
            moments[0] += known.sum(axis=(1, 2))
            moments[1] += np.where(known, values, 0.0).sum(axis=(1, 2))
            moments[2] += np.where(known, values**2, 0.0).sum(axis=(1, 2))
        return moments


def target_scale(datasets: Sequence[RegressionTileDataset], labels: Sequence[str]) -> tuple[list[float], list[float]]:
    """The targets' mean and std per value over the training datasets (:meth:`RegressionTileDataset.target_moments`);
    a std of 0 (a constant target) becomes 1. A value without any target fails with one line naming the files."""
    moments = sum((dataset.target_moments() for dataset in datasets), np.zeros((3, len(labels))))
    means, stds = [], []
    for k, label in enumerate(labels):
        count, total, squares = moments[:, k]
        if count == 0:
            files = ", ".join(sorted({dataset.targets.path for dataset in datasets})) or "no training scene"
            raise InputError(f"{files}: no target value of {label} on the training tiles (all nodata)")
        mean = total / count
        std = math.sqrt(max(squares / count - mean**2, 0.0))
        means.append(float(mean))
        stds.append(float(std) if std > 1e-6 else 1.0)
    return means, stds
