"""One scene's class map from its ranks' rasters (``classes.tif``, optionally ``probabilities.tif``); its polygons
are :mod:`rasterscale.tasks.segmentation.vectorize`'s.

:func:`merge_class_rasters` assembles the rank rasters block by block: a block starts as no data (255) and takes
the pixels each rank raster claims (a pixel claimed twice is an error naming both files); pixels the scene's
imagery marks invalid become no data. The assembled raster becomes a COG whose overviews take the most frequent
class (mode); the probabilities' overviews are averages. Memory is a block's pixels, whatever the raster's size.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import rasterio
from rasterio.windows import Window

from rasterscale.atomic import check_written, writing
from rasterscale.raster.cog import convert_to_cog
from rasterscale.raster.imagery import ImageSpec
from rasterscale.tasks.blending import (
    block_windows,
    claimed_pieces,
    open_merge_sources,
    rank_window,
    scratch_path,
    window_valid_mask,
)
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.rankoutput import PROBABILITY_SCALE

__all__ = [
    "assemble_block",
    "block_windows",
    "class_summary",
    "count_classes",
    "merge_class_rasters",
    "rank_window",
    "scratch_path",
    "window_valid_mask",
]

MERGE_BLOCK = 512
CACHE_MB = 16  # GDAL's block cache while merging or vectorizing (each block is read once; GDAL's default, 5%


def assembly_profile(scene: rasterio.io.DatasetReader, count: int, block: int, nodata: int | None) -> dict:
    return {
        "driver": "GTiff",
        "width": scene.width,
        "height": scene.height,
        "count": count,
        "dtype": "uint8",
        "crs": scene.crs,
        "transform": scene.transform,
        "nodata": nodata,
        "tiled": True,
        "blockxsize": block,
        "blockysize": block,
        "compress": "deflate",
    }


def merge_class_rasters(
    rank_rasters: Sequence[str | Path],
    raster_path: str | Path,
    spec: ImageSpec,
    classes_path: str | Path,
    probabilities_path: str | Path | None,
    labels: Sequence[str],
    block: int = MERGE_BLOCK,
    cache_mb: int = CACHE_MB,
) -> dict:
    """Assemble the rank rasters into ``classes_path`` (uint8 COG, nodata 255, mode overviews; the scene's CRS,
    transform and size) and, when asked, ``probabilities_path`` (one uint8 band per class, scale 1/255, an
    internal mask where there is no class, average overviews). Returns pixels per class label and no data pixels.
    GDAL's block cache is bounded to ``cache_mb`` meanwhile.
    """
    num_classes = len(labels)
    with contextlib.ExitStack() as stack:
        bands = (
            None if probabilities_path is None else (1 + num_classes, f"1 + {num_classes} (classes and probabilities)")
        )
        scene, ranks = open_merge_sources(stack, raster_path, rank_rasters, cache_mb, bands)
        classes = open_classes(stack, Path(classes_path), scene, block, labels)
        probabilities = None
        if probabilities_path is not None:
            probabilities = open_probabilities(stack, Path(probabilities_path), scene, block, labels)
        counts = assemble_classes(ranks, scene, spec, block, classes, probabilities)
        classes.finish(block, "mode")
        if probabilities is not None:
            probabilities.finish(block, "average", add_mask=True)
    return class_summary(counts, labels)


@dataclass(frozen=True)
class Assembly:
    """A scratch raster (``tmp``, open for writing as ``dst``) in which a scene's merged output is assembled,
    and the output it becomes."""

    output: Path
    tmp: Path
    dst: Any  # rasterio's dataset writer

    def finish(self, block: int, resampling: Literal["mode", "average"], add_mask: bool = False) -> None:
        """Close the scratch raster and make it the output: a COG of ``block`` px blocks whose overviews take
        ``resampling`` (``add_mask``: with the scratch raster's mask as its internal mask)."""
        self.dst.close()
        check_written(self.output)  # GDAL may lose a failed write at close without raising
        convert_to_cog(self.tmp, self.output, block_size=block, overview_resampling=resampling, add_mask=add_mask)


def open_classes(
    stack: contextlib.ExitStack, classes_path: Path, scene: rasterio.io.DatasetReader, block: int, labels: Sequence[str]
) -> Assembly:
    """The scratch raster of the scene's classes (one band, nodata :data:`NODATA_CLASS`), open in ``stack``."""
    tmp = stack.enter_context(scratch_path(classes_path, "assembly"))
    dst = stack.enter_context(rasterio.open(tmp, "w", **assembly_profile(scene, 1, block, NODATA_CLASS)))
    dst.update_tags(labels=json.dumps(list(labels)))
    dst.set_band_description(1, "class")
    return Assembly(classes_path, tmp, dst)


def open_probabilities(
    stack: contextlib.ExitStack,
    probabilities_path: Path,
    scene: rasterio.io.DatasetReader,
    block: int,
    labels: Sequence[str],
) -> Assembly:
    """The scratch raster of the scene's probabilities (a band per class, scale 1/255, an internal mask), open in
    ``stack``."""
    tmp = stack.enter_context(scratch_path(probabilities_path, "assembly"))
    stack.enter_context(rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True))
    dst = stack.enter_context(rasterio.open(tmp, "w", **assembly_profile(scene, len(labels), block, None)))
    dst.scales = [PROBABILITY_SCALE] * len(labels)
    dst.descriptions = tuple(f"probability of {label}" for label in labels)
    return Assembly(probabilities_path, tmp, dst)


def assemble_classes(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]],
    scene: rasterio.io.DatasetReader,
    spec: ImageSpec,
    block: int,
    classes_out: Assembly,
    probs_out: Assembly | None,
) -> np.ndarray:
    """Write the scene's classes (and with ``probs_out`` its probabilities, masked where there is no class) block
    by block from the rank rasters, pixels the imagery masks as no data; returns the pixels of each class id. A
    full file system is a DiskFullError naming the output whose scratch raster it stopped."""
    counts = np.zeros(256, dtype=np.int64)
    num_probabilities = probs_out.dst.count if probs_out is not None else 0
    for window in block_windows(scene.width, scene.height, block):
        classes, probs = assemble_block(ranks, window, num_probabilities)
        valid = window_valid_mask(scene, spec, window)
        if valid is not None:
            classes[~valid] = NODATA_CLASS
        counts += np.bincount(classes.ravel(), minlength=256)
        with writing(classes_out.output):
            classes_out.dst.write(classes, 1, window=window)
        if probs_out is not None:
            with writing(probs_out.output):
                probs_out.dst.write(probs, window=window)
                probs_out.dst.write_mask(np.where(classes != NODATA_CLASS, 255, 0).astype(np.uint8), window=window)
    return counts


def assemble_block(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]], window: Window, num_probabilities: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """One block's classes (255 where no rank claims a pixel) and, when ``num_probabilities``, probabilities
    (C, h, w); a pixel claimed by two rank rasters raises ValueError naming both."""
    shape = (int(window.height), int(window.width))
    classes = np.full(shape, NODATA_CLASS, dtype=np.uint8)
    probs = np.zeros((num_probabilities, *shape), dtype=np.uint8) if num_probabilities else None
    for src, inside, rows, cols, data, claimed in claimed_pieces(ranks, window, _classified, indexes=1):
        classes[rows, cols][claimed] = data[claimed]
        if probs is not None:
            values = src.read(list(range(2, 2 + num_probabilities)), window=inside)
            probs[:, rows, cols][:, claimed] = values[:, claimed]
    return classes, probs


def _classified(classes: np.ndarray) -> np.ndarray:
    """The pixels a rank raster claims: those it gave a class."""
    return classes != NODATA_CLASS


def class_summary(counts: np.ndarray, labels: Sequence[str]) -> dict:
    """Pixels per class label (ids without a label as ``class <id>``) and no data pixels."""
    pixels = {label: int(counts[k]) for k, label in enumerate(labels)}
    for class_id in np.flatnonzero(counts):
        if len(labels) <= class_id < NODATA_CLASS:
            pixels[f"class {class_id}"] = int(counts[class_id])
    return {"pixels": pixels, "nodata_pixels": int(counts[NODATA_CLASS])}


def count_classes(classes_path: str | Path, labels: Sequence[str], block: int = MERGE_BLOCK) -> dict[str, int]:
    """A class map's pixels per class label (as :func:`class_summary` names them), read block by block; class 0
    is left out when it is ``background``, as the class polygons leave it out."""
    counts = np.zeros(256, dtype=np.int64)
    with rasterio.Env(GDAL_CACHEMAX=CACHE_MB * 2**20), rasterio.open(classes_path) as src:
        for window in block_windows(src.width, src.height, block):
            counts += np.bincount(src.read(1, window=window).ravel(), minlength=256)
    pixels = class_summary(counts, labels)["pixels"]
    if labels and labels[0] == "background":
        del pixels[labels[0]]
    return pixels
