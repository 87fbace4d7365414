"""One scene's class map from its ranks' rasters (``classes.tif``, optionally ``probabilities.tif``) and, when
asked, its polygons (:mod:`rasterscale.tasks.segmentation.vectorize`'s).

:func:`merge_class_rasters` assembles the rank rasters block by block: a block starts as no data (255) and takes
the pixels each rank raster claims (a pixel claimed twice is an error naming both files); pixels the scene's
imagery marks invalid become no data. The assembled raster becomes a COG whose overviews take the most frequent
class (mode); the probabilities' overviews are averages. The polygons are read from the assembled classes while
the probabilities become their COG (:func:`rasterscale.tasks.merging.finish_layers`). Memory is a block's pixels,
whatever the raster's size.
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
    rank_window,
    scratch_path,
    window_valid_mask,
)
from rasterscale.tasks.segmentation import NODATA_CLASS, PROBABILITY_SCALE
from rasterscale.tasks.segmentation.vectorize import vectorize_classes

__all__ = [
    "CACHE_MB",
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


def layer_profile(scene: rasterio.io.DatasetReader, count: int, nodata: int | None) -> dict[str, Any]:
    """A uint8 layer of ``count`` bands on the scene's grid."""
    return {
        "width": scene.width,
        "height": scene.height,
        "count": count,
        "dtype": "uint8",
        "crs": scene.crs,
        "transform": scene.transform,
        "nodata": nodata,
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
    gpkg_path: str | Path | None = None,
    threads: int = 1,
) -> dict:
    """Assemble the rank rasters into ``classes_path`` (uint8 COG, nodata 255, mode overviews; the scene's CRS,
    transform and size) and, when asked, ``probabilities_path`` (one uint8 band per class, scale 1/255, an
    internal mask where there is no class, average overviews). Returns pixels per class label and no data pixels,
    and with ``gpkg_path`` the class polygons written there (:func:`vectorize_classes`) and their number
    (``polygons``). GDAL's block cache is bounded to ``cache_mb`` meanwhile; the COGs are compressed, side by side,
    on ``threads`` cores.
    """
    num_classes = len(labels)
    with contextlib.ExitStack() as stack:
        bands = (
            None if probabilities_path is None else (1 + num_classes, f"1 + {num_classes} (classes and probabilities)")
        )
        scene, ranks = open_merge_sources(stack, raster_path, rank_rasters, cache_mb, bands)
        layers = [open_classes(stack, Path(classes_path), scene, block, labels)]
        if probabilities_path is not None:
            layers.append(open_probabilities(stack, Path(probabilities_path), scene, block, labels))
        counts = assemble_classes(ranks, scene, spec, block, *layers)
        polygons = finish_layers(layers, threads, lambda: _polygons(layers[0].tmp, gpkg_path, labels, cache_mb))
    summary = class_summary(counts, labels)
    return summary if polygons is None else {**summary, "polygons": polygons}


def _polygons(classes: Path, gpkg_path: str | Path | None, labels: Sequence[str], cache_mb: int) -> int | None:
    """The polygons of the assembled classes written to ``gpkg_path`` (None: none asked), and their number."""
    return None if gpkg_path is None else vectorize_classes(classes, gpkg_path, labels, cache_mb=cache_mb)


def open_classes(
    stack: contextlib.ExitStack, classes_path: Path, scene: rasterio.io.DatasetReader, block: int, labels: Sequence[str]
) -> ScratchLayer:
    """The scratch raster of the scene's classes (one band, nodata :data:`NODATA_CLASS`), open in ``stack``."""
    layer = open_layer(stack, classes_path, layer_profile(scene, 1, NODATA_CLASS), "mode", block)
    layer.dst.update_tags(labels=json.dumps(list(labels)))
    layer.dst.set_band_description(1, "class")
    return layer


def open_probabilities(
    stack: contextlib.ExitStack,
    probabilities_path: Path,
    scene: rasterio.io.DatasetReader,
    block: int,
    labels: Sequence[str],
) -> ScratchLayer:
    """The scratch raster of the scene's probabilities (a band per class, scale 1/255, an internal mask), open in
    ``stack``."""
    stack.enter_context(rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True))
    layer = open_layer(stack, probabilities_path, layer_profile(scene, len(labels), None), "average", block)
    layer.dst.scales = [PROBABILITY_SCALE] * len(labels)
    layer.dst.descriptions = tuple(f"probability of {label}" for label in labels)
    return layer


def assemble_classes(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]],
    scene: rasterio.io.DatasetReader,
    spec: ImageSpec,
    block: int,
    classes_out: ScratchLayer,
    probs_out: ScratchLayer | None = None,
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
            known = classes != NODATA_CLASS
            probs *= known  # 0 under the mask, as rio_cogeo's conversion of a masked raster wrote it
            with writing(probs_out.output):
                probs_out.dst.write(probs, window=window)
                probs_out.dst.write_mask(np.where(known, 255, 0).astype(np.uint8), window=window)
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
        np.copyto(classes[rows, cols], data, where=claimed)  # in place, without gathering the pixels first
        if probs is not None:
            values = src.read(list(range(2, 2 + num_probabilities)), window=inside)
            np.copyto(probs[:, rows, cols], values, where=claimed)
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
