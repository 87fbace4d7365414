"""The points task's project layer (:mod:`rasterscale.tasks.detectors.project`): every source's owned points (each
source keeps the points where it owns the map: a scene's by its footprint, a seam's by its core), then the
duplicates left where two owners meet (a tree top found by a scene and by a seam, a little to either side of the
core's edge) removed: of two points of one class from different sources or scenes closer than
``merge.point_distance``, the better scoring is kept."""

from __future__ import annotations

import numpy as np

from rasterscale.scene import ProjectJobFields
from rasterscale.tasks.detectors.project import apart, owned_layer, write_project
from rasterscale.tasks.points.merge import LAYER, one_per_place


def merge_project(job: ProjectJobFields) -> str:
    """Write the project's points (GeoParquet and GeoPackage, or a partition of them:
    :func:`~rasterscale.tasks.detectors.project.write_project`); a line for the log."""
    frame, owned = owned_layer(job)
    if len(frame):
        xy = np.column_stack([frame.geometry.x.to_numpy(), frame.geometry.y.to_numpy()])
        labels = frame["label"].astype(str).to_numpy()
        scores = frame["score"].to_numpy(dtype=np.float64)
        distance = job.settings.merge.point_distance

        def from_two_sides(i: np.ndarray, j: np.ndarray) -> np.ndarray:
            return apart(frame, i, j)

        frame = frame[one_per_place(xy, scores, labels, distance, from_two_sides)]
    merged = frame.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
    return write_project(job, merged, owned, "points", layer=LAYER)
