"""Datasets over tile manifests: windowed reads, one raster handle per dataloader worker, or views of a region.

A rasterio dataset handle must not cross a fork, so each process (the rank itself, or each of its dataloader
workers) opens its own on first use. Only the window of the tile is read: memory does not grow with the raster.

Prediction has three dataloader strategies (``predict.strategy``, DeepForest's names):

- ``window``: each tile's window is read when it is needed, in parallel dataloader workers, each with its own
  raster handle. Memory stays flat whatever the raster's size.
- ``single``: the rank's region (the bounding window of its tiles) is read once into CPU memory; tiles are
  views of it, sent to the device batch by batch.
- ``batch``: the rank's region is read once onto the device; tiles are views of the device tensor (no copies,
  no worker processes). The region must fit in device memory.

Every reader takes the scene's :class:`~rasterscale.raster.imagery.ImageSpec` (stored with its manifest): the bands,
the mask and the scale that make the raster's pixels the model's tiles (:func:`rasterscale.raster.imagery.read_tile`):
uint8 bands scaled to 0-255, or raw float32 values for a model that normalizes them. Prediction tiles stay uint8
until they reach the device (:func:`to_model_input` scales them there): a quarter of the bytes to read, pin and
copy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
import torch
from rasterio.enums import Interleaving
from rasterio.env import set_gdal_config
from rasterio.windows import Window
from torch.utils.data import Dataset

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec, ProcessRaster, read_tile
from rasterscale.raster.remote import open_raster
from rasterscale.raster.windows import bounding_window, tile_window

PREDICT_STRATEGIES = ("window", "single", "batch")
RGB_PIXEL_BYTES = 3  # the pixels ``predict.read_cache_mb`` is sized for: three uint8 bands


class ReadCache:
    """GDAL's block cache of this process (and of the dataloader workers it forks later), sized for the raster it
    reads: ``predict.read_cache_mb`` is for RGB uint8 pixels, and a raster of more bytes per pixel (bands, wider
    data types) gets as many times more (:func:`read_cache_bytes`), so that the same row of blocks fits at any band
    count. Unbounded (GDAL's default, 5% of the node's memory) until :meth:`limit` is called: only prediction ranks
    bound it."""

    def __init__(self) -> None:
        self.megabytes: int | None = None

    def limit(self, megabytes: int) -> None:
        """Bound the cache to ``megabytes`` MB for RGB uint8 pixels, until a raster is opened (:meth:`fit`)."""
        self.megabytes = int(megabytes)
        set_gdal_config("GDAL_CACHEMAX", read_cache_bytes(self.megabytes))  # set at run time, GDAL takes bytes

    def fit(self, src: rasterio.io.DatasetReader, spec: ImageSpec) -> int | None:
        """Size the bound for the raster ``src`` just opened in this process, read through ``spec``; the bytes set
        (None: the cache is not bounded here)."""
        if self.megabytes is None:
            return None
        nbytes = read_cache_bytes(self.megabytes, cached_pixel_bytes(src, spec))
        set_gdal_config("GDAL_CACHEMAX", nbytes)
        return nbytes


READ_CACHE = ReadCache()  # this process's (a forked worker starts with its rank's)


def read_cache_bytes(megabytes: int, pixel_bytes: int = RGB_PIXEL_BYTES) -> int:
    """GDAL's block cache in bytes for ``megabytes`` MB of RGB uint8 pixels, grown in proportion for
    ``pixel_bytes`` bytes per cached pixel (never shrunk below it): 16 MB holds a row of 21 blocks of 512 px (a
    raster up to 10,752 px wide), of RGB as of 13 bands of uint16 (139 MB)."""
    return int(megabytes) * 2**20 * max(pixel_bytes, RGB_PIXEL_BYTES) // RGB_PIXEL_BYTES


def cached_pixel_bytes(src: rasterio.io.DatasetReader, spec: ImageSpec) -> int:
    """Bytes per pixel that GDAL caches when ``spec``'s bands of ``src`` are read: every band of a
    pixel-interleaved raster (a block holds them all, and GDAL caches each band's part of it), the bands read (and
    the alpha band) of a band-interleaved one; one byte more for a dataset mask."""
    itemsize = max(np.dtype(dtype).itemsize for dtype in src.dtypes)
    bands = len(spec.indexes) if src.count > 1 and src.interleaving == Interleaving.band else src.count
    return bands * itemsize + (1 if spec.mask == "dataset" else 0)


class RasterHandle(ProcessRaster):
    """A scene's per-process handle that reads tiles as the model's, through its imagery spec."""

    def __init__(self, path: str | Path, spec: ImageSpec) -> None:
        super().__init__(path)
        self.spec = spec

    def opened(self, src: rasterio.io.DatasetReader) -> None:
        """The raster is opened in this process: the process's block cache is sized for it (:data:`READ_CACHE`,
        where a prediction rank bounds it)."""
        READ_CACHE.fit(src, self.spec)

    def read_pixels(self, tile: Tile) -> np.ndarray:
        """The tile as the model's pixels (the spec's bands, scale or raw values, and fill), shape (bands, height,
        width)."""
        return read_tile(self.src, self.spec, tile_window(tile), tile.tile_id)

    def read_rgb(self, tile: Tile) -> torch.Tensor:
        """The tile as the model's float tensor ([0, 1] scaled, or raw values), shape (bands, height, width)."""
        return pixels_to_tensor(self.read_pixels(tile))


def limit_read_cache(megabytes: int) -> None:
    """Bound GDAL's block cache in this process and in the dataloader workers it forks later (GDAL's default,
    5% of the node's memory, would otherwise fill up over a large raster): ``megabytes`` for RGB uint8, grown for a
    raster of more bytes per pixel when a process opens it to read tiles (:class:`ReadCache`)."""
    READ_CACHE.limit(megabytes)


def pixels_to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """A tile's pixels as the model's float tensor, [0, 1] scaled or raw values (training)."""
    return to_model_input(pixels_to_raw_tensor(pixels))


def pixels_to_raw_tensor(pixels: np.ndarray) -> torch.Tensor:
    """A tile's pixels as they are read, uint8 (prediction: scaled on the device) or float32 raw values."""
    if pixels.dtype not in (np.uint8, np.float32):
        raise TypeError(
            f"tiles reach the model as uint8 or float32, not {pixels.dtype} (read them through an ImageSpec)"
        )
    return torch.from_numpy(np.ascontiguousarray(pixels))


def to_model_input(image: torch.Tensor) -> torch.Tensor:
    """A tile as the model takes it, where the tile is (on the device): uint8 to float in [0, 1], raw values as
    they are; training's :func:`pixels_to_tensor` does the same."""
    return image.float().div_(255.0) if image.dtype == torch.uint8 else image


class WindowDataset(Dataset):
    """Prediction tiles read window by window (strategy ``window``): item -> (uint8 image, tile_id)."""

    def __init__(self, raster_path: str | Path, tiles: Sequence[Tile], spec: ImageSpec) -> None:
        self.raster = RasterHandle(raster_path, spec)
        self.tiles = list(tiles)

    def __len__(self) -> int:
        return len(self.tiles)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        tile = self.tiles[index]
        return pixels_to_raw_tensor(self.raster.read_pixels(tile)), tile.tile_id


def tiles_window(tiles: Sequence[Tile]) -> Window:
    """The smallest window holding every tile (a rank's tiles are contiguous rows of the manifest: a band)."""
    window = bounding_window(tile_window(t) for t in tiles)
    assert window is not None, "a region of no tiles"
    return window


def region_nbytes(window: Window, spec: ImageSpec) -> int:
    """Bytes that :func:`load_region` holds for ``window`` (the spec's bands, uint8 or float32)."""
    return spec.count * spec.dtype.itemsize * int(window.width) * int(window.height)


def load_region(
    raster_path: str | Path,
    window: Window,
    spec: ImageSpec,
    device: torch.device | str = "cpu",
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """A window as one (bands, height, width) tensor on ``device`` (uint8, or float32 raw values), read through
    ``spec``.

    It is read ``chunk_rows`` rows at a time into the tensor allocated on the device, so that beyond the
    region itself only one chunk is ever held in host memory.
    """
    height, width = int(window.height), int(window.width)
    dtype = torch.float32 if spec.raw else torch.uint8
    region = torch.empty((spec.count, height, width), dtype=dtype, device=device)
    with open_raster(raster_path) as src:
        for row in range(0, height, chunk_rows):
            rows = min(chunk_rows, height - row)
            chunk = read_tile(src, spec, Window(window.col_off, window.row_off + row, width, rows))
            region[:, row : row + rows].copy_(pixels_to_raw_tensor(chunk))
    return region


class RegionDataset(Dataset):
    """Prediction tiles as views of a region already in memory (strategies ``single`` and ``batch``):
    item -> (view, tile_id). ``origin`` is the region's (col_off, row_off) in the raster."""

    def __init__(self, region: torch.Tensor, origin: tuple[int, int], tiles: Sequence[Tile]) -> None:
        self.region, self.origin, self.tiles = region, origin, list(tiles)

    def __len__(self) -> int:
        return len(self.tiles)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        tile = self.tiles[index]
        col, row = tile.col_off - self.origin[0], tile.row_off - self.origin[1]
        return self.region[:, row : row + tile.height, col : col + tile.width], tile.tile_id


def prediction_dataset(
    strategy: str,
    raster_path: str | Path,
    tiles: Sequence[Tile],
    spec: ImageSpec,
    device: torch.device | str = "cpu",
) -> Dataset:
    """A rank's tiles under a dataloader strategy; ``single`` and ``batch`` read only the rank's region."""
    if strategy not in PREDICT_STRATEGIES:
        raise ValueError(f"unknown dataloader strategy {strategy!r} (one of {', '.join(PREDICT_STRATEGIES)})")
    if strategy == "window" or not tiles:
        return WindowDataset(raster_path, tiles, spec)
    window = tiles_window(tiles)
    target = torch.device(device if strategy == "batch" else "cpu")
    check_region_fits(region_nbytes(window, spec), target)
    region = load_region(raster_path, window, spec, target)
    return RegionDataset(region, (int(window.col_off), int(window.row_off)), tiles)


def check_region_fits(nbytes: int, device: torch.device, headroom: float = 0.5) -> None:
    """Fail with one line when a GPU region would take more than ``headroom`` of the device's free memory
    (the model and its activations need the rest). Free counts what torch's caching allocator holds unused: the
    driver counts it as taken, and a job's next scene is read after its previous scene's region was let go into
    that cache (with the last batches' activations), so the driver's figure alone refused a second scene the size of
    a first that fitted."""
    if device.type == "cuda":
        driver_free, _ = torch.cuda.mem_get_info(device)
        free = driver_free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if nbytes > headroom * free:
            raise RuntimeError(
                f"strategy batch: the rank's region needs {nbytes / 2**20:.0f} MB on {device}, which has "
                f"{free / 2**20:.0f} MB free; use predict.strategy window or single, or more ranks"
            )


def loader_workers(strategy: str, workers: int) -> int:
    """Worker processes of a strategy: only ``window`` reads in workers; ``single`` and ``batch`` only slice a
    region in memory (``batch``'s is a device tensor, which cannot cross a fork)."""
    return workers if strategy == "window" else 0


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


def collate_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """Detection batches are lists (torchvision detectors take lists of images)."""
    images, extras = zip(*batch, strict=True)
    return list(images), list(extras)
