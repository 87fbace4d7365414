"""Datasets over tile manifests: windowed reads, one raster handle per dataloader worker.

A rasterio dataset handle must not cross a fork, so each process (the rank itself, or each of its dataloader
workers) opens its own on first use. Only the window of the tile is read: memory does not grow with the raster.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
import torch
from rasterio.windows import Window
from torch.utils.data import Dataset

from rasterscale.geo import box_areas
from rasterscale.tiling import Tile


class RasterHandle:
    """A lazily opened, per-process rasterio handle (safe across fork and pickling)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._src: rasterio.io.DatasetReader | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_src": None, "_pid": None}

    @property
    def src(self) -> rasterio.io.DatasetReader:
        if self._src is None or self._pid != os.getpid():
            self._src = rasterio.open(self.path)
            self._pid = os.getpid()
        return self._src

    def read_rgb(self, tile: Tile) -> torch.Tensor:
        """The tile's first three bands as a float tensor in [0, 1], shape (3, height, width)."""
        window = Window(tile.col_off, tile.row_off, tile.width, tile.height)
        pixels = self.src.read(indexes=[1, 2, 3], window=window)
        return pixels_to_tensor(pixels)


def pixels_to_tensor(pixels: np.ndarray) -> torch.Tensor:
    scale = 255.0 if pixels.dtype == np.uint8 else float(np.iinfo(pixels.dtype).max)
    return torch.from_numpy(np.ascontiguousarray(pixels)).float().div_(scale)


class WindowDataset(Dataset):
    """Prediction tiles read window by window: item -> (image, tile_id)."""

    def __init__(self, raster_path: str | Path, tiles: Sequence[Tile]) -> None:
        self.raster = RasterHandle(raster_path)
        self.tiles = list(tiles)

    def __len__(self) -> int:
        return len(self.tiles)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        tile = self.tiles[index]
        return self.raster.read_rgb(tile), tile.tile_id


class DummyDataset(Dataset):
    """Random tiles with a simulated read delay: checks an environment without any raster."""

    def __init__(self, count: int, size: int, delay: float = 0.0, seed: int = 0) -> None:
        self.count, self.size, self.delay, self.seed = count, size, delay, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.delay:
            time.sleep(self.delay)
        generator = torch.Generator().manual_seed(self.seed + index)
        return torch.rand(3, self.size, self.size, generator=generator), index


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


def augment_flips(image: torch.Tensor, boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random horizontal and vertical flips (boxes follow); torch's RNG is seeded per worker and epoch."""
    _, height, width = image.shape
    if torch.rand(1).item() < 0.5:
        image = image.flip(-1)
        boxes = torch.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1)
    if torch.rand(1).item() < 0.5:
        image = image.flip(-2)
        boxes = torch.stack([boxes[:, 0], height - boxes[:, 3], boxes[:, 2], height - boxes[:, 1]], dim=1)
    return image, boxes


class TrainTileDataset(Dataset):
    """Training tiles with their ground-truth boxes clipped to the tile: item -> (image, target)."""

    def __init__(
        self,
        raster_path: str | Path,
        tiles: Sequence[Tile],
        boxes: np.ndarray,
        labels: np.ndarray,
        min_visible_fraction: float = 0.5,
        augment: bool = True,
    ) -> None:
        self.raster = RasterHandle(raster_path)
        self.tiles = list(tiles)
        self.boxes, self.labels = np.asarray(boxes, dtype=np.float64), np.asarray(labels, dtype=np.int64)
        self.min_visible_fraction, self.augment = min_visible_fraction, augment

    def __len__(self) -> int:
        return len(self.tiles)

    def target(self, index: int) -> dict[str, torch.Tensor]:
        boxes, labels = boxes_in_tile(self.boxes, self.labels, self.tiles[index], self.min_visible_fraction)
        return {"boxes": torch.from_numpy(boxes).reshape(-1, 4), "labels": torch.from_numpy(labels)}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image = self.raster.read_rgb(self.tiles[index])
        target = self.target(index)
        if self.augment:
            image, target["boxes"] = augment_flips(image, target["boxes"])
        return image, target


def collate_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """Detection batches are lists (torchvision detectors take lists of images)."""
    images, extras = zip(*batch, strict=True)
    return list(images), list(extras)
