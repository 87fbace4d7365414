"""Segmentation's training samples: tiles of a scene with their class masks from its ground truth."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.raster.windows import tile_window
from rasterscale.tasks.dense import DenseTileDataset
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.groundtruth import SegmentationTruth


class SegmentationTileDataset(DenseTileDataset):
    """Training tiles with their class masks: item -> (float image (3, h, w) in [0, 1], LongTensor mask (h, w)).

    Mask pixels are :data:`NODATA_CLASS` (to ignore in the loss) where the imagery is masked (the spec's mask) or
    the ground truth says nothing. ``sample``: the same, image and mask flipped together (training's augmentation:
    :mod:`rasterscale.datasets.sampling`).
    """

    def __init__(
        self, raster_path: str | Path, tiles: Sequence[Tile], spec: ImageSpec, truth: SegmentationTruth
    ) -> None:
        super().__init__(raster_path, tiles, spec)
        self.truth = truth

    def mask(self, tile: Tile) -> np.ndarray:
        """The tile's class ids (uint8), :data:`NODATA_CLASS` where the imagery is masked."""
        window = tile_window(tile)
        return self.masked(window, self.truth.tile_classes(window), NODATA_CLASS)

    def targets_of(self, tile: Tile) -> torch.Tensor:
        return torch.from_numpy(self.mask(tile).astype(np.int64))
