"""A downsampled picture of a scene with predicted points (red crosses) and true points (cyan rings) on top, the
points task's quicklook: the picture of :mod:`rasterscale.tasks.detectors.quicklook` (a decimated read, overviews
when present, scaled for display by :mod:`rasterscale.raster.imagery`), markers instead of outlines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from rasterscale.atomic import save_figure
from rasterscale.raster.imagery import decoding, display_uint8, picture_inches
from rasterscale.raster.remote import open_raster

MARKER_WIDTH = 0.8  # points: the crosses' and rings' lines


def read_picture(raster: str | Path, max_side: int) -> tuple[np.ndarray, int, int]:
    """The raster's first three bands (a single band as grey) read decimated to at most ``max_side`` pixels a side,
    as uint8 for display (rows, cols, 3); and the raster's width and height in pixels."""
    with open_raster(raster) as src:
        scale = max(1.0, max(src.width, src.height) / max_side)
        shape = (3, max(1, int(src.height / scale)), max(1, int(src.width / scale)))
        indexes = [1, 2, 3] if src.count >= 3 else [1, 1, 1]
        with decoding(str(raster)):
            image = display_uint8(src.read(indexes=indexes, out_shape=shape))
        return np.moveaxis(image, 0, -1), src.width, src.height


def render_points_quicklook(
    raster: str | Path,
    predicted_px: np.ndarray,
    true_px: np.ndarray | None,
    png: str | Path,
    title: str = "",
    max_side: int = 1600,
) -> None:
    """Decimated read of the raster with points on top, each (column, row) in the raster's pixels: predicted as red
    crosses, true as cyan rings (``true_px`` None for a scene without ground truth: the legend says so). Written
    atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image, width, height = read_picture(raster, max_side)
    fig, ax = plt.subplots(figsize=picture_inches(image.shape[0], image.shape[1], min(800, max_side)), dpi=100)
    ax.imshow(image, extent=(0, width, height, 0))
    # true rings first, predicted crosses on top: a prediction on its truth shows inside the ring
    if true_px is not None:
        true = np.asarray(true_px, dtype=np.float64).reshape(-1, 2)
        ax.scatter(
            true[:, 0],
            true[:, 1],
            s=40,
            marker="o",
            facecolors="none",
            edgecolors="cyan",
            linewidths=MARKER_WIDTH,
            label=f"true ({len(true)})",
        )
    predicted = np.asarray(predicted_px, dtype=np.float64).reshape(-1, 2)
    ax.scatter(
        predicted[:, 0],
        predicted[:, 1],
        s=18,
        c="red",
        marker="x",
        linewidths=MARKER_WIDTH,
        label=f"predicted ({len(predicted)})",
    )
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_axis_off()
    ax.legend(loc="lower right", fontsize=7, framealpha=0.7)
    legend = "red: predicted, cyan: true" if true_px is not None else "red: predicted, no ground truth"
    ax.set_title(f"{title}  ({legend})", fontsize=9)
    save_figure(fig, png)


def scored_points(path: str | Path, min_score: float) -> np.ndarray:
    """A merged layer's points in raster pixels, (N, 2) of (``px_x``, ``px_y``), of those scoring at least
    ``min_score``."""
    frame = pd.read_parquet(path, columns=["px_x", "px_y", "score"])
    return frame.loc[frame["score"] >= min_score, ["px_x", "px_y"]].to_numpy(dtype=np.float64).reshape(-1, 2)
