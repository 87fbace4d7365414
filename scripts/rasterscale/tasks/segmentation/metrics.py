"""Segmentation scores against ground truth: confusion matrix, per-class IoU, mean IoU and pixel accuracy.

The confusion matrix counts pixels by (true class, predicted class), rows truth; pixels that either side marks
:data:`~rasterscale.tasks.segmentation.NODATA_CLASS` are left out. A class absent from both truth and
prediction has no IoU (None) and is left out of the mean. :func:`evaluate_class_map` streams a scene's class
raster block by block against its :class:`~rasterscale.tasks.segmentation.groundtruth.SegmentationTruth`, so memory
stays flat whatever the scene's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from rasterio.windows import Window

from rasterscale.atomic import save_figure
from rasterscale.raster.imagery import decoding, display_uint8, picture_inches
from rasterscale.raster.remote import open_raster
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.groundtruth import SegmentationTruth


def confusion_matrix(pred: np.ndarray, truth: np.ndarray, num_classes: int, ignore: int = NODATA_CLASS) -> np.ndarray:
    """(C, C) int64 pixel counts, row = true class, column = predicted class; ``ignore`` on either side skipped."""
    pred, truth = np.asarray(pred).ravel(), np.asarray(truth).ravel()
    if pred.shape != truth.shape:
        raise ValueError(f"prediction has {pred.size} pixels, truth {truth.size}")
    keep = (pred != ignore) & (truth != ignore)
    pred, truth = pred[keep].astype(np.int64), truth[keep].astype(np.int64)
    outside = (pred < 0) | (pred >= num_classes) | (truth < 0) | (truth >= num_classes)
    if outside.any():
        raise ValueError(f"class ids must be 0..{num_classes - 1} (or {ignore}, ignored)")
    counts = np.bincount(truth * num_classes + pred, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes)


def iou_scores(confusion: np.ndarray, labels: Sequence[str]) -> dict[str, Any]:
    """{"iou": {label: IoU or None}, "miou": mean of the IoUs there are, "pixel_accuracy", "pixels"}."""
    confusion = np.asarray(confusion, dtype=np.int64)
    if confusion.shape != (len(labels), len(labels)):
        raise ValueError(f"a {confusion.shape} confusion matrix for {len(labels)} labels")
    hits = np.diag(confusion)
    union = confusion.sum(axis=0) + confusion.sum(axis=1) - hits
    ious = {label: (float(hits[k] / union[k]) if union[k] else None) for k, label in enumerate(labels)}
    present = [v for v in ious.values() if v is not None]
    total = int(confusion.sum())
    return {
        "iou": ious,
        "miou": float(np.mean(present)) if present else None,
        "pixel_accuracy": float(hits.sum() / total) if total else None,
        "pixels": total,
    }


def class_map_blocks(width: int, height: int, block: int) -> list[Window]:
    """Square windows of ``block`` pixels covering a raster, row by row."""
    return [
        Window(col, row, min(block, width - col), min(block, height - row))
        for row in range(0, height, block)
        for col in range(0, width, block)
    ]


def evaluate_class_map(classes_tif: str | Path, truth: SegmentationTruth, block: int = 1024) -> dict[str, Any]:
    """Scores of a class raster (band 1, :data:`NODATA_CLASS` = no prediction) against the scene's truth, read
    block by block; also the confusion matrix (rows truth) and the labels."""
    labels = list(truth.labels)
    confusion = np.zeros((len(labels), len(labels)), dtype=np.int64)
    with rasterio.open(classes_tif) as src:
        if (src.width, src.height) != (truth.width, truth.height) or not src.transform.almost_equals(truth.transform):
            raise ValueError(
                f"{classes_tif}: {src.width}x{src.height} px class map is not on the grid of the ground truth "
                f"({truth.width}x{truth.height} px)"
            )
        for window in class_map_blocks(src.width, src.height, block):
            confusion += confusion_matrix(src.read(1, window=window), truth.tile_classes(window), len(labels))
    return {**iou_scores(confusion, labels), "confusion": confusion.tolist(), "labels": labels}


def render_segmentation_quicklook(
    raster: str | Path,
    classes_tif: str | Path,
    truth: SegmentationTruth | None,
    png: str | Path,
    max_side: int = 1024,
    title: str = "",
) -> None:
    """A decimated picture of the scene: predicted classes (other than class 0) filled, one colour per class,
    true class boundaries outlined in cyan. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    with open_raster(raster) as src:
        scale = max(1.0, max(src.width, src.height) / max_side)
        shape = (max(1, int(src.height / scale)), max(1, int(src.width / scale)))
        with decoding(str(raster)):
            image = display_uint8(src.read(indexes=[1, 2, 3], out_shape=(3, *shape)))
    with rasterio.open(classes_tif) as src:
        predicted = src.read(1, out_shape=shape)  # nearest neighbour
    num_classes = (
        len(truth.labels) if truth is not None else int(predicted[predicted != NODATA_CLASS].max(initial=0)) + 1
    )
    colours = plt.get_cmap("tab10")(np.arange(max(num_classes, 2)) % 10)
    colours[:, 3] = 0.45
    colours[0, 3] = 0.0  # class 0 (background) left clear
    overlay = np.ma.masked_where((predicted == NODATA_CLASS) | (predicted == 0), predicted)

    fig, ax = plt.subplots(figsize=picture_inches(*shape, min(800, max_side)), dpi=100)
    ax.imshow(np.moveaxis(image, 0, -1), interpolation="nearest")
    ax.imshow(overlay, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1, interpolation="nearest")
    if truth is not None:
        true_classes = truth.classes_at(shape).astype(np.int16)
        true_classes[true_classes == NODATA_CLASS] = -1
        levels = np.arange(num_classes) + 0.5
        ax.contour(true_classes, levels=levels, colors="cyan", linewidths=0.6)
    ax.set_axis_off()
    legend = "filled: predicted, cyan: true outlines" if truth is not None else "filled: predicted"
    ax.set_title(f"{title}  ({legend})", fontsize=9)
    save_figure(fig, png)
