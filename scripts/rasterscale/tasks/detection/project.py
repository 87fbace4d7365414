"""Detection's project layer (:mod:`rasterscale.tasks.detectors.project`): every source's owned boxes, then the
duplicates left where two owners meet removed by greedy NMS over pairs of boxes *from different sources or
scenes*: a pair is a duplicate above ``project.iou_threshold``, or when ``merge.containment_threshold`` of the
smaller box lies inside the other.
"""

from __future__ import annotations

import geopandas as gpd
import numpy as np

from rasterscale.raster.geo import box_areas, box_pairs, intersection_areas, pair_ious
from rasterscale.scene import ProjectJobFields
from rasterscale.tasks.detectors.merge import greedy_nms
from rasterscale.tasks.detectors.project import PROJECT_COLUMNS, apart, owned_layer, write_project

__all__ = ["PROJECT_COLUMNS", "cross_source_duplicates", "merge_project"]


def cross_source_duplicates(frame: gpd.GeoDataFrame, iou: float, containment: float) -> np.ndarray:
    """Keep-mask: greedy NMS by score over pairs of same-label boxes from different sources or scenes (a seam's
    boxes on the two sides of its border) that overlap at ``iou``, or whose smaller box lies ``containment`` inside
    the other."""
    boxes = frame.geometry.bounds.to_numpy(dtype=np.float64)
    i, j = box_pairs(boxes)
    inside = intersection_areas(boxes[i], boxes[j]) / np.maximum(
        np.minimum(box_areas(boxes[i]), box_areas(boxes[j])), 1e-12
    )
    duplicate = apart(frame, i, j) & ((pair_ious(boxes[i], boxes[j]) > iou) | (inside >= containment))
    return greedy_nms(frame["score"].to_numpy(dtype=np.float64), i[duplicate], j[duplicate])


def merge_project(job: ProjectJobFields) -> str:
    """Write the project's detections (GeoParquet and GeoPackage, or a partition of them:
    :func:`~rasterscale.tasks.detectors.project.write_project`); a line for the log."""
    frame, owned = owned_layer(job)
    keep = cross_source_duplicates(frame, job.settings.project.iou_threshold, job.settings.merge.containment_threshold)
    merged = frame[keep].sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
    return write_project(job, merged, owned, "detections", layer="detections")
