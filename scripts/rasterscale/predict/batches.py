"""A prediction rank's tiles as batches: its tiles of every scene of the job, scene after scene, read by the
dataloader's workers (:class:`ScenesDataset`, under the ``predict.strategy``:
:mod:`rasterscale.datasets.tiles`), cut into batches that never mix two tile shapes (:meth:`ScenesDataset.batches`),
each collated into one tensor (:func:`collate_tiles`: pinned by the dataloader on a GPU rank, copied once)."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, default_collate

from rasterscale.datasets.tiles import prediction_dataset, region_nbytes, tiles_window
from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.tasks.api import PredictScene

LOGGER_NAME = "rasterscale.predict"

TileBatch = tuple[torch.Tensor, list[tuple[int, int]], float]  # images (B, C, H, W), keys, seconds reading them


class Batches(Sampler[list[int]]):
    """Batches of item indices, made beforehand (a dataloader's ``batch_sampler``)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def collate_tiles(items: list[tuple[torch.Tensor, tuple[int, int], float]]) -> TileBatch:
    """A batch of tiles of one shape as one tensor, their keys, and the seconds their reads took in all."""
    images, keys, seconds = zip(*items, strict=True)
    # default_collate stacks into shared memory in a worker: the batch crosses to the rank without another copy
    return default_collate(list(images)), list(keys), float(sum(seconds))


def scene_dataset(
    strategy: str, raster_path: str, tiles: list[Tile], imagery: ImageSpec, device: torch.device
) -> Dataset:
    """One scene's tiles of a rank under the strategy (single and batch read the rank's region of it here)."""
    if strategy != "window" and tiles:
        logging.getLogger(LOGGER_NAME).info(
            "strategy %s holds the region of %s of %.0f MB on %s",
            strategy,
            raster_path,
            region_nbytes(tiles_window(tiles), imagery) / 2**20,
            device if strategy == "batch" else "cpu",
        )
    return prediction_dataset(strategy, raster_path, tiles, imagery, device)


class ScenesDataset(Dataset):
    """Several scenes' tiles, scene after scene: item -> (image, (scene index, position among the scene's tiles),
    seconds to read it).

    A scene's dataset is made when its first tile is asked for and dropped when the next scene's is, so that a
    process holds one scene's region (strategies single and batch) or raster handle at a time: items must be
    asked for in order, as a prediction dataloader does (each worker process goes forward through its batches).
    """

    def __init__(self, factories: Sequence[Any], sizes: Sequence[int], shapes: Sequence[Hashable]) -> None:
        self.factories, self.shapes = list(factories), list(shapes)
        self.starts = np.cumsum([0, *sizes])
        self.current: tuple[int, Dataset] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "current": None}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, tuple[int, int], float]:
        """The tile, its key, and the seconds reading it took (its scene's region or raster opened included)."""
        started = time.perf_counter()
        scene = int(np.searchsorted(self.starts, index, side="right")) - 1
        if self.current is None or self.current[0] != scene:
            self.current = None  # the previous scene's region goes before the next one's is read
            self.current = (scene, self.factories[scene]())
        position = index - int(self.starts[scene])
        image, _ = self.current[1][position]
        return image, (scene, position), time.perf_counter() - started

    def batches(self, batch_size: int) -> Batches:
        """The items in order, in batches of ``batch_size`` that never mix two scenes' tile shapes (a batch is one
        tensor)."""
        batches: list[list[int]] = []
        shape = None
        for scene, (start, stop) in enumerate(itertools.pairwise(self.starts)):
            for index in range(int(start), int(stop)):
                if not batches or len(batches[-1]) == batch_size or self.shapes[scene] != shape:
                    batches.append([])
                    shape = self.shapes[scene]
                batches[-1].append(index)
        return Batches(batches)


def rank_dataset(
    scenes: Sequence[PredictScene], predicted: Sequence[Sequence[Tile]], strategy: str, device: torch.device
) -> ScenesDataset:
    """A rank's tiles to predict (``predicted``, of each scene) of every scene of the job, scene after scene
    (:class:`ScenesDataset`), with each scene's tile shape."""
    factories = [
        functools.partial(scene_dataset, strategy, scene.raster, list(tiles), scene.imagery, device)
        for scene, tiles in zip(scenes, predicted, strict=True)
    ]
    shapes = [tile_shape(scene, tiles) for scene, tiles in zip(scenes, predicted, strict=True)]
    return ScenesDataset(factories, [len(tiles) for tiles in predicted], shapes)


def tile_shape(scene: PredictScene, tiles: Sequence[Tile]) -> Hashable:
    """What a scene's tiles are as a tensor: bands, height, width, raw values or not (a scene's tiles are one size)."""
    first = tiles[0] if tiles else None
    return (scene.imagery.count, scene.imagery.raw, first.height if first else 0, first.width if first else 0)
