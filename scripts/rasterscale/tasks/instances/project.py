"""Instances' project layer (:mod:`rasterscale.tasks.detectors.project`): every source's owned crowns in the project's
CRS, then the duplicates left where two owners meet removed by greedy NMS over pairs of crowns *from different
sources or scenes*: a pair is a duplicate above ``project.iou_threshold`` of *polygon* IoU, or when
``merge.containment_threshold`` of the smaller crown lies inside the other. Areas and perimeters are measured
again in the project's CRS."""

from __future__ import annotations

import geopandas as gpd
import numpy as np
import shapely

from rasterscale.scene import ProjectJobFields
from rasterscale.tasks.detectors.merge import greedy_nms
from rasterscale.tasks.detectors.project import apart, owned_layer, write_project
from rasterscale.tasks.instances.merge import LAYER, crown_layer
from rasterscale.tasks.instances.polygons import ious_of, overlap_areas, polygon_pairs

PROJECT_CROWN_COLUMNS = ["scene", "source", "label", "score", "area_m2", "perimeter_m", "geometry"]


def cross_source_duplicates(frame: gpd.GeoDataFrame, iou: float, containment: float) -> np.ndarray:
    """Keep-mask: greedy NMS by score over pairs of same-label crowns from different sources or scenes whose
    polygons overlap at ``iou``, or whose smaller polygon lies ``containment`` inside the other."""
    geometries = np.asarray(frame.geometry.array, dtype=object)
    i, j = polygon_pairs(geometries)
    candidates = apart(frame, i, j)
    i, j = i[candidates], j[candidates]
    areas = shapely.area(geometries)
    inter = overlap_areas(geometries[i], geometries[j])
    inside = inter / np.maximum(np.minimum(areas[i], areas[j]), 1e-12)
    duplicate = (ious_of(inter, areas[i], areas[j]) > iou) | (inside >= containment)
    return greedy_nms(frame["score"].to_numpy(dtype=np.float64), i[duplicate], j[duplicate])


def merge_project(job: ProjectJobFields) -> str:
    """Write the project's crowns (GeoParquet and GeoPackage, or a partition of them:
    :func:`~rasterscale.tasks.detectors.project.write_project`); a line for the log."""
    frame, owned = owned_layer(job)
    keep = cross_source_duplicates(frame, job.settings.project.iou_threshold, job.settings.merge.containment_threshold)
    merged = frame[keep].sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
    crowns = crown_layer(merged, job.crs).assign(scene=merged["scene"].to_numpy(), source=merged["source"].to_numpy())
    return write_project(job, crowns[PROJECT_CROWN_COLUMNS], owned, "crowns", layer=LAYER)
