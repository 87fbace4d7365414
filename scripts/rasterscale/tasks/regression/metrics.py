"""Regression scores against the targets: MAE, RMSE, bias (mean of predicted - true) and R², over all pixels and by
range of the true value, and the predicted-against-true density plot.

Scores are sums, so they stream: :class:`ErrorSums` adds a block's pixels (those with both a prediction and a target)
at a time, and :func:`evaluate_values` reads a scene's ``values.tif`` and its targets block by block, memory flat
whatever the scene's size. The ranges are :data:`RANGE_EDGES` of the true value (for heights in metres: below 2 m,
2-10 m, 10-20 m, 20 m and above); a range without pixels has no scores (None). R² is 1 - SSE / SST around the
true values' own mean (of the pixels scored), None for a constant target.

The density plot (:func:`render_density_plot`: the scene's quicklook) is a 2-D histogram of predicted against true
values, accumulated block by block too, on a log colour scale, with the 1:1 line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import rasterio

from rasterscale.atomic import save_figure
from rasterscale.tasks.merging import block_windows
from rasterscale.tasks.regression.groundtruth import TargetRaster
from rasterscale.tasks.regression.merge import read_values

RANGE_EDGES = (2.0, 10.0, 20.0)  # ranges of the true value: < 2, 2-10, 10-20, >= 20 (metres, for heights)
HISTOGRAM_BINS = 200  # per axis of the density plot
RANGE_SIDE = 512  # longest side of the decimated reads the density plot's axis range is taken from


def range_names(edges: Sequence[float] = RANGE_EDGES) -> list[str]:
    """The ranges' names: ``<2``, ``2-10``, ``10-20``, ``>=20``."""
    inner = [f"{edges[k]:g}-{edges[k + 1]:g}" for k in range(len(edges) - 1)]
    return [f"<{edges[0]:g}", *inner, f">={edges[-1]:g}"]


@dataclass
class ErrorSums:
    """Sums of one value's errors over the pixels added: count, Σe, Σ|e|, Σe², Σt, Σt² (e = predicted - true)."""

    count: int = 0
    error: float = 0.0
    absolute: float = 0.0
    squared: float = 0.0
    truth: float = 0.0
    truth_squared: float = 0.0

    def add(self, predicted: np.ndarray, true: np.ndarray) -> None:
        """Pixels with both values (the caller leaves the others out)."""
        if not predicted.size:
            return
        errors = predicted.astype(np.float64) - true
        true = true.astype(np.float64)
        self.count += int(errors.size)
        self.error += float(errors.sum())
        self.absolute += float(np.abs(errors).sum())
        self.squared += float((errors**2).sum())
        self.truth += float(true.sum())
        self.truth_squared += float((true**2).sum())

    def scores(self) -> dict[str, Any]:
        """{pixels, mae, rmse, bias, r2}; None for scores without pixels (r2: without spread of the targets)."""
        if not self.count:
            return {"pixels": 0, "mae": None, "rmse": None, "bias": None, "r2": None}
        n = self.count
        total = self.truth_squared - self.truth**2 / n  # Σ (t - mean t)²
        r2 = 1.0 - self.squared / total if total > 1e-12 * max(1.0, self.truth_squared) else None
        return {
            "pixels": n,
            "mae": self.absolute / n,
            "rmse": math.sqrt(self.squared / n),
            "bias": self.error / n,
            "r2": r2,
        }


@dataclass
class ValueScores:
    """One value's sums, overall and by range of the true value (:data:`RANGE_EDGES`)."""

    edges: tuple[float, ...] = RANGE_EDGES
    overall: ErrorSums = field(default_factory=ErrorSums)
    ranges: list[ErrorSums] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranges = [ErrorSums() for _ in range(len(self.edges) + 1)]

    def add(self, predicted: np.ndarray, true: np.ndarray) -> None:
        """Pixels of a block: NaN on either side is left out."""
        known = np.isfinite(predicted) & np.isfinite(true)
        predicted, true = predicted[known], true[known]
        self.overall.add(predicted, true)
        which = np.searchsorted(np.asarray(self.edges), true, side="right")
        for k, sums in enumerate(self.ranges):
            chosen = which == k
            sums.add(predicted[chosen], true[chosen])

    def scores(self) -> dict[str, Any]:
        ranges = {name: sums.scores() for name, sums in zip(range_names(self.edges), self.ranges, strict=True)}
        return {**self.overall.scores(), "by_range": ranges}


class DensityHistogram:
    """Predicted-against-true counts on a square grid of ``bins`` over [low, high] on both axes (values outside are
    clipped into the edge bins)."""

    def __init__(self, low: float, high: float, bins: int = HISTOGRAM_BINS) -> None:
        self.low, self.high = low, high if high > low else low + 1.0
        self.edges = np.linspace(self.low, self.high, bins + 1)
        self.counts = np.zeros((bins, bins), dtype=np.int64)  # [true bin, predicted bin]

    def add(self, predicted: np.ndarray, true: np.ndarray) -> None:
        known = np.isfinite(predicted) & np.isfinite(true)
        p = np.clip(predicted[known], self.low, self.high)
        t = np.clip(true[known], self.low, self.high)
        counts, _, _ = np.histogram2d(t, p, bins=(self.edges, self.edges))
        self.counts += counts.astype(np.int64)


def _check_grid(values_tif: str | Path, src: rasterio.io.DatasetReader, targets: TargetRaster) -> None:
    if (src.width, src.height) != (targets.width, targets.height) or not src.transform.almost_equals(targets.transform):
        raise ValueError(
            f"{values_tif}: {src.width}x{src.height} px values are not on the grid of the scene's targets "
            f"({targets.width}x{targets.height} px)"
        )


def value_range(src: rasterio.io.DatasetReader, targets: TargetRaster, side: int = RANGE_SIDE) -> tuple[float, float]:
    """The density plot's axis range: the 0.1st to 99.9th percentile of the true and predicted values of decimated
    reads (the whole rasters are never read at once)."""
    scale = max(1.0, max(src.width, src.height) / side)
    shape = (max(1, round(src.height / scale)), max(1, round(src.width / scale)))
    sample = np.concatenate(
        [read_values(src, out_shape=(src.count, *shape)).ravel(), targets.read_decimated(shape).ravel()]
    )
    sample = sample[np.isfinite(sample)]
    if not sample.size:
        return 0.0, 1.0
    low, high = np.percentile(sample, [0.1, 99.9])
    return float(min(low, 0.0)), float(high)


def evaluate_values(
    values_tif: str | Path, targets: TargetRaster, labels: Sequence[str], block: int = 1024
) -> tuple[dict[str, Any], list[DensityHistogram]]:
    """Scores of a values raster against the scene's targets, read block by block: per label its overall scores and
    by range of the true value; the first label's scores also at the top level. And the density histograms, one
    per label."""
    scores = [ValueScores() for _ in labels]
    with rasterio.open(values_tif) as src:
        _check_grid(values_tif, src, targets)
        if src.count != len(labels):
            raise ValueError(f"{values_tif}: {src.count} bands, expected {len(labels)} ({', '.join(labels)})")
        low, high = value_range(src, targets)
        histograms = [DensityHistogram(low, high) for _ in labels]
        for window in block_windows(src.width, src.height, block):
            predicted, true = read_values(src, window), targets.read(window)
            for k in range(len(labels)):
                scores[k].add(predicted[k], true[k])
                histograms[k].add(predicted[k], true[k])
    per_label = {label: value.scores() for label, value in zip(labels, scores, strict=True)}
    first = per_label[labels[0]]
    metrics = {key: first[key] for key in ("pixels", "mae", "rmse", "bias", "r2")}
    return {**metrics, "values": per_label, "labels": list(labels), "range_edges": list(RANGE_EDGES)}, histograms


def render_density_plot(
    histograms: Sequence[DensityHistogram], labels: Sequence[str], png: str | Path, title: str = ""
) -> None:
    """Predicted against true values, one panel per label: pixel counts on a log colour scale, the 1:1 line.
    Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.6), dpi=100, squeeze=False)
    for ax, histogram, label in zip(axes[0], histograms, labels, strict=True):
        counts = np.ma.masked_equal(histogram.counts, 0)
        extent = (histogram.low, histogram.high, histogram.low, histogram.high)
        vmax = max(1, int(histogram.counts.max()))
        image = ax.imshow(
            counts.T, origin="lower", extent=extent, norm=LogNorm(vmin=1, vmax=max(vmax, 2)), cmap="viridis"
        )
        ax.plot([histogram.low, histogram.high], [histogram.low, histogram.high], color="red", lw=0.8, label="1:1")
        ax.set_xlabel(f"true {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        fig.colorbar(image, ax=ax, label="pixels")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, png)


def render_values_quicklook(values_tif: str | Path, png: str | Path, title: str = "", max_side: int = 1024) -> None:
    """A decimated picture of a scene's predicted values (its first value; no data left white), for a scene without
    targets. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rasterscale.raster.imagery import picture_inches

    with rasterio.open(values_tif) as src:
        scale = max(1.0, max(src.width, src.height) / max_side)
        shape = (max(1, int(src.height / scale)), max(1, int(src.width / scale)))
        values = read_values(src, out_shape=(src.count, *shape))[0]
        label = (src.descriptions[0] or "value") if src.descriptions else "value"
    fig, ax = plt.subplots(figsize=picture_inches(*shape, min(800, max_side)), dpi=100)
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"predicted {label}", shrink=0.8)
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    save_figure(fig, png)
