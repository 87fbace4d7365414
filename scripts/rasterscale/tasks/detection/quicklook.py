"""A downsampled picture of a scene with predicted and true boxes (:mod:`rasterscale.tasks.detectors.quicklook`)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from rasterscale.tasks.detectors.merge import BOX_COLUMNS
from rasterscale.tasks.detectors.quicklook import render_quicklook


def box_outlines(boxes: np.ndarray) -> list[np.ndarray]:
    """The four corners of each (xmin, ymin, xmax, ymax) box."""
    return [np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]]) for x0, y0, x1, y1 in boxes]


# (raster, predicted boxes, true boxes or None, png, max_side=1600, title=""): boxes in raster pixels outlined
render_detections_quicklook = partial(render_quicklook, outlines=box_outlines)


def scored_boxes(path: str | Path, min_score: float) -> np.ndarray:
    """A merged layer's boxes in raster pixels, (N, 4), of the detections scoring at least ``min_score``."""
    frame = pd.read_parquet(path, columns=[*BOX_COLUMNS, "score"])
    return frame.loc[frame["score"] >= min_score, BOX_COLUMNS].to_numpy(dtype=np.float64)
