"""Segmentation's training samples: tiles of a scene with their class masks from its ground truth."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from rasterscale.datasets.sampling import NO_FLIPS, Flips
from rasterscale.datasets.tiles import RasterHandle
from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec, read_masked
from rasterscale.raster.windows import tile_window
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.groundtruth import SegmentationTruth


class SegmentationTileDataset(Dataset):
    """Training tiles with their class masks: item -> (float image (3, h, w) in [0, 1], LongTensor mask (h, w)).

    Mask pixels are :data:`NODATA_CLASS` (to ignore in the loss) where the imagery is masked (the spec's mask) or
    the ground truth says nothing. ``sample``: the same, image and mask flipped together (training's augmentation:
    :mod:`rasterscale.datasets.sampling`).
    """

    def __init__(
        self,
        raster_path: str | Path,
        tiles: Sequence[Tile],
        spec: ImageSpec,
        truth: SegmentationTruth,
    ) -> None:
        self.raster = RasterHandle(raster_path, spec)
        self.tiles, self.truth = list(tiles), truth

    def __len__(self) -> int:
        return len(self.tiles)

    def mask(self, tile: Tile) -> np.ndarray:
        """The tile's class ids (uint8), :data:`NODATA_CLASS` where the imagery is masked."""
        window = tile_window(tile)
        classes = self.truth.tile_classes(window)
        if self.raster.spec.mask != "none":
            valid = read_masked(self.raster.src, self.raster.spec, window=window)[1]
            if valid is not None:
                classes[~valid] = NODATA_CLASS
        return classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(index, NO_FLIPS)

    def sample(self, index: int, flips: Flips) -> tuple[torch.Tensor, torch.Tensor]:
        tile = self.tiles[index]
        image = self.raster.read_rgb(tile)
        mask = torch.from_numpy(self.mask(tile).astype(np.int64))
        if flips.horizontal:
            image, mask = image.flip(-1), mask.flip(-1)
        if flips.vertical:
            image, mask = image.flip(-2), mask.flip(-2)
        return image.contiguous(), mask.contiguous()
