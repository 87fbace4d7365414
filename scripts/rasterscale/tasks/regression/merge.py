"""One scene's values (``values.tif``) from its ranks' value rasters, and the project's mosaic of them.

:func:`merge_value_rasters` assembles the rank rasters block by block: a block starts as no data and takes the
pixels each rank raster claims (its finite values; a pixel claimed twice is an error naming both files); pixels
the scene's imagery marks invalid become no data. The assembled raster becomes a float32 COG, nodata
:data:`NODATA_VALUE`, one band per value (described by its label), whose overviews are averages (of the pixels with
data). Memory is a block's pixels, whatever the raster's size.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from rasterio.windows import Window

from rasterscale.atomic import writing
from rasterscale.raster.imagery import ImageSpec
from rasterscale.tasks.merging import (
    CACHE_MB,
    ScratchLayer,
    block_windows,
    claimed_pieces,
    finish_layers,
    open_layer,
    open_merge_sources,
    window_valid_mask,
)

NODATA_VALUE = -9999.0  # no data in values.tif (a value no height, or other target, takes)
MERGE_BLOCK = 512


def values_profile(scene: rasterio.io.DatasetReader, count: int) -> dict[str, Any]:
    """A float32 layer of ``count`` bands on the scene's grid, nodata :data:`NODATA_VALUE`."""
    return {
        "width": scene.width,
        "height": scene.height,
        "count": count,
        "dtype": "float32",
        "crs": scene.crs,
        "transform": scene.transform,
        "nodata": NODATA_VALUE,
    }


def merge_value_rasters(
    rank_rasters: Sequence[str | Path],
    raster_path: str | Path,
    spec: ImageSpec,
    values_path: str | Path,
    labels: Sequence[str],
    block: int = MERGE_BLOCK,
    cache_mb: int = CACHE_MB,
    threads: int = 1,
) -> dict[str, Any]:
    """Assemble the rank rasters into ``values_path`` (float32 COG, nodata :data:`NODATA_VALUE`, average overviews;
    the scene's CRS, transform and size), compressed on ``threads`` cores. Returns the pixels with values, the
    pixels of no data, and each value's mean."""
    with contextlib.ExitStack() as stack:
        bands = (len(labels), f"{len(labels)} ({', '.join(labels)})")
        scene, ranks = open_merge_sources(stack, raster_path, rank_rasters, cache_mb, bands)
        layer = open_layer(stack, Path(values_path), values_profile(scene, len(labels)), "average", block)
        layer.dst.update_tags(labels=json.dumps(list(labels)))
        layer.dst.descriptions = tuple(labels)
        count, nodata, sums = assemble_layer(ranks, scene, spec, block, layer)
        finish_layers([layer], threads, lambda: None)
    means = {label: (float(sums[k] / count) if count else None) for k, label in enumerate(labels)}
    return {"pixels": count, "nodata_pixels": nodata, "mean": means}


def assemble_layer(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]],
    scene: rasterio.io.DatasetReader,
    spec: ImageSpec,
    block: int,
    layer: ScratchLayer,
) -> tuple[int, int, np.ndarray]:
    """Write the scene's values block by block from the rank rasters, pixels the imagery masks as no data; returns
    the pixels with values, those of no data, and each band's sum over the first."""
    count, nodata, sums = 0, 0, np.zeros(layer.dst.count)
    for window in block_windows(scene.width, scene.height, block):
        values = assemble_values(ranks, window, layer.dst.count)
        valid = window_valid_mask(scene, spec, window)
        if valid is not None:
            values[:, ~valid] = np.nan
        known = np.isfinite(values).all(axis=0)
        count += int(known.sum())
        nodata += int(known.size - known.sum())
        sums += np.where(known, values, 0.0).sum(axis=(1, 2), dtype=np.float64)
        with writing(layer.output):
            layer.dst.write(np.where(known, values, NODATA_VALUE).astype(np.float32), window=window)
    return count, nodata, sums


def assemble_values(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]], window: Window, bands: int
) -> np.ndarray:
    """One block's values (K, h, w) float32, NaN where no rank claims a pixel; a pixel claimed by two rank rasters
    raises ValueError naming both."""
    values = np.full((bands, int(window.height), int(window.width)), np.nan, dtype=np.float32)
    for _, _, rows, cols, data, claimed in claimed_pieces(ranks, window, lambda data: np.isfinite(data).any(axis=0)):
        np.copyto(values[:, rows, cols], data, where=claimed)  # in place, without gathering the pixels first
    return values


def read_values(src: rasterio.io.DatasetReader, window: Window | None = None, **read: Any) -> np.ndarray:
    """A values raster's bands (K, h, w) float32 with NaN where it has no data."""
    data = src.read(window=window, **read).astype(np.float32)
    if src.nodata is not None:
        data[data == src.nodata] = np.nan
    return data


def count_values(values_path: str | Path, labels: Sequence[str], block: int = MERGE_BLOCK) -> dict[str, int]:
    """The pixels with a value of each label, read block by block (the report's counts)."""
    counts = np.zeros(len(labels), dtype=np.int64)
    with rasterio.Env(GDAL_CACHEMAX=CACHE_MB * 2**20), rasterio.open(values_path) as src:
        for window in block_windows(src.width, src.height, block):
            counts += np.isfinite(read_values(src, window)).sum(axis=(1, 2))
    return {label: int(counts[k]) for k, label in enumerate(labels)}
