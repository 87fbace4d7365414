"""A downsampled picture of a scene with predicted and true boxes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rasterscale.tasks.quicklook import render_outlines


def box_outlines(boxes: np.ndarray) -> list[np.ndarray]:
    """The four corners of each (xmin, ymin, xmax, ymax) box."""
    return [np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]]) for x0, y0, x1, y1 in boxes]


def render_quicklook(
    raster_path: str | Path,
    pred_boxes: np.ndarray,
    true_boxes: np.ndarray | None,
    png_path: str | Path,
    max_side: int = 1600,
    title: str = "",
) -> None:
    """Decimated read (overviews when present) with boxes in pixel units drawn on top."""
    true = box_outlines(true_boxes) if true_boxes is not None else None
    render_outlines(raster_path, box_outlines(pred_boxes), true, png_path, max_side, title)
