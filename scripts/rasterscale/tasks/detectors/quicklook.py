"""A downsampled picture of a scene with outlines drawn on top (predicted in red, ground truth in cyan), the
quicklook of the tasks that find objects: each task says how its shapes are outlined (boxes, polygons)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from rasterscale.atomic import save_figure
from rasterscale.raster.imagery import decoding, display_uint8, picture_inches
from rasterscale.raster.remote import open_raster

# a task's shapes in the raster's pixels (boxes, polygons) -> their outlines, each a (K, 2) array of (column, row)
Outlines = Callable[[np.ndarray], list[np.ndarray]]


def render_outlines(
    raster_path: str | Path,
    predicted: Sequence[np.ndarray],
    true: Sequence[np.ndarray] | None,
    png_path: str | Path,
    max_side: int = 1600,
    title: str = "",
) -> None:
    """Decimated read (overviews when present) with outlines drawn on top: each a (K, 2) array of (column, row)
    in the raster's pixels; ``true`` None for a scene without ground truth (the legend says so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    with open_raster(raster_path) as src:
        scale = max(1.0, max(src.width, src.height) / max_side)
        shape = (3, max(1, int(src.height / scale)), max(1, int(src.width / scale)))
        with decoding(str(raster_path)):
            image = display_uint8(src.read(indexes=[1, 2, 3], out_shape=shape))
        width, height = src.width, src.height
    fig, ax = plt.subplots(figsize=picture_inches(shape[1], shape[2], min(800, max_side)), dpi=100)
    ax.imshow(np.moveaxis(image, 0, -1), extent=(0, width, height, 0))
    if true is not None and len(true):
        ax.add_collection(PolyCollection(list(true), facecolors="none", edgecolors="cyan", linewidths=0.6))
    if len(predicted):
        ax.add_collection(PolyCollection(list(predicted), facecolors="none", edgecolors="red", linewidths=0.6))
    ax.set_axis_off()
    legend = "red: predicted, cyan: true" if true is not None else "red: predicted"
    ax.set_title(f"{title}  ({legend})", fontsize=9)
    save_figure(fig, png_path)


def render_quicklook(
    raster_path: str | Path,
    predicted: np.ndarray,
    true: np.ndarray | None,
    png_path: str | Path,
    max_side: int = 1600,
    title: str = "",
    *,
    outlines: Outlines,
) -> None:
    """Decimated read (overviews when present) with a task's shapes in the raster's pixels outlined on top (as
    ``outlines`` draws them); ``true`` None for a scene without ground truth. A task's quicklook binds ``outlines``
    (:func:`functools.partial`)."""
    true_outlines = outlines(true) if true is not None else None
    render_outlines(raster_path, outlines(predicted), true_outlines, png_path, max_side, title)
