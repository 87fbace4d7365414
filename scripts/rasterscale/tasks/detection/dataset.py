"""Detection's training samples: tiles of a scene with the ground-truth boxes they hold, flipped as the sampling
says."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from rasterscale.datasets.sampling import NO_FLIPS, Flips
from rasterscale.datasets.tiles import RasterHandle
from rasterscale.grid.tile import Tile
from rasterscale.raster.geo import box_areas
from rasterscale.raster.imagery import ImageSpec


def boxes_in_tile(
    boxes: np.ndarray, labels: np.ndarray, tile: Tile, min_visible_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes clipped to the tile, in tile pixels; a box keeps when enough of it lies inside the tile."""
    x0, y0 = tile.col_off, tile.row_off
    clipped = np.stack(
        [
            np.clip(boxes[:, 0], x0, x0 + tile.width),
            np.clip(boxes[:, 1], y0, y0 + tile.height),
            np.clip(boxes[:, 2], x0, x0 + tile.width),
            np.clip(boxes[:, 3], y0, y0 + tile.height),
        ],
        axis=1,
    )
    full = box_areas(boxes)
    visible = box_areas(clipped)
    keep = (visible > 0) & (visible >= min_visible_fraction * full)
    local = clipped[keep] - np.array([x0, y0, x0, y0], dtype=clipped.dtype)
    return local.astype(np.float32), labels[keep]


def flip_image_and_boxes(image: torch.Tensor, boxes: torch.Tensor, flips: Flips) -> tuple[torch.Tensor, torch.Tensor]:
    """The image flipped, and its (N, 4) pixel boxes with it."""
    _, height, width = image.shape
    if flips.horizontal:
        image = image.flip(-1)
        boxes = torch.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1)
    if flips.vertical:
        image = image.flip(-2)
        boxes = torch.stack([boxes[:, 0], height - boxes[:, 3], boxes[:, 2], height - boxes[:, 1]], dim=1)
    return image, boxes


class TrainTileDataset(Dataset):
    """Training tiles with their ground-truth boxes clipped to the tile: item -> (image, target); ``sample``: the
    same, flipped (training's augmentation: :mod:`rasterscale.datasets.sampling`)."""

    def __init__(
        self,
        raster_path: str | Path,
        tiles: Sequence[Tile],
        spec: ImageSpec,
        boxes: np.ndarray,
        labels: np.ndarray,
        min_visible_fraction: float = 0.5,
    ) -> None:
        self.raster = RasterHandle(raster_path, spec)
        self.tiles = list(tiles)
        self.boxes, self.labels = np.asarray(boxes, dtype=np.float64), np.asarray(labels, dtype=np.int64)
        self.min_visible_fraction = min_visible_fraction

    def __len__(self) -> int:
        return len(self.tiles)

    def target(self, index: int) -> dict[str, torch.Tensor]:
        boxes, labels = boxes_in_tile(self.boxes, self.labels, self.tiles[index], self.min_visible_fraction)
        return {"boxes": torch.from_numpy(boxes).reshape(-1, 4), "labels": torch.from_numpy(labels)}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.sample(index, NO_FLIPS)

    def sample(self, index: int, flips: Flips) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image = self.raster.read_rgb(self.tiles[index])
        target = self.target(index)
        image, target["boxes"] = flip_image_and_boxes(image, target["boxes"], flips)
        return image, target
