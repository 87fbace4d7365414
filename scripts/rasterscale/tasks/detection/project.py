"""Detection's project layer: every predicted scene's and seam's merged detections in one layer, in the project's
CRS, each object once.

Each source keeps the detections centred where it owns the map (:class:`rasterscale.grid.project.Ownership`): a
crown on a border between two scenes comes from their seam, whose tiles saw it whole. Then the duplicates left
where two owners meet (the same crown found by a scene and by a seam, its centre a little to either side of the
core's edge) are removed by greedy NMS over pairs of boxes *from different sources or scenes*: a pair is a
duplicate above ``project.iou_threshold``, or when ``merge.containment_threshold`` of the smaller box lies inside
the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd
import shapely
from shapely.geometry import box

from rasterscale.atomic import write_geoparquet, write_gpkg
from rasterscale.grid.project import Ownership, is_seam
from rasterscale.raster.geo import box_areas, box_pairs, intersection_areas, pair_ious
from rasterscale.tasks.objects import greedy_nms

PROJECT_COLUMNS = ["scene", "source", "label", "score", "geometry"]


def source_area(source: Mapping[str, Any], crs: str) -> shapely.Geometry | None:
    """A source's footprint (a scene's) or core (a seam's), in the project's CRS; None for a scene whose header
    the plan did not read (a demo scene not yet made)."""
    if "core" in source:
        area = shapely.from_wkt(source["core"])
    elif "bounds" in source:
        area = box(*source["bounds"])
    else:
        return None
    if source["crs"] == crs:
        return area
    step = max(area.length / 256, 1e-9)  # densified: a straight edge bends in another CRS
    return gpd.GeoSeries([shapely.segmentize(area, step)], crs=source["crs"]).to_crs(crs).iloc[0]


def ownership_of(sources: Sequence[Mapping[str, Any]], crs: str) -> Ownership:
    footprints: dict[str, shapely.Geometry] = {}
    cores: dict[str, shapely.Geometry] = {}
    for source in sources:
        area = source_area(source, crs)
        if area is not None:
            (cores if is_seam(source["name"]) else footprints)[source["name"]] = area
    return Ownership(footprints, cores)


def owned_detections(source: Mapping[str, Any], crs: str, ownership: Ownership) -> gpd.GeoDataFrame:
    """A source's merged detections in the project's CRS, those it owns."""
    frame = gpd.read_parquet(source["parquet"])
    frame = frame.set_crs(source.get("crs") or crs, allow_override=frame.crs is None)
    if frame.crs != crs:
        frame = frame.to_crs(crs)
    name = source["name"]
    frame = frame.assign(scene=name, source=name)[PROJECT_COLUMNS]
    if len(frame) and (name in ownership.footprints or name in ownership.cores):
        centres = frame.geometry.centroid
        x, y = centres.x.to_numpy(), centres.y.to_numpy()
        frame = frame.assign(scene=ownership.scene_of(name, x, y))[ownership.keeps(name, x, y)]
    return frame


def cross_source_duplicates(frame: gpd.GeoDataFrame, iou: float, containment: float) -> np.ndarray:
    """Keep-mask: greedy NMS by score over pairs of same-label boxes from different sources or scenes (a seam's
    boxes on the two sides of its border) that overlap at ``iou``, or whose smaller box lies ``containment`` inside
    the other."""
    boxes = frame.geometry.bounds.to_numpy(dtype=np.float64)
    i, j = box_pairs(boxes)
    sources = pd.factorize(frame["source"])[0]
    scenes = pd.factorize(frame["scene"])[0]
    labels = pd.factorize(frame["label"])[0]
    inside = intersection_areas(boxes[i], boxes[j]) / np.maximum(
        np.minimum(box_areas(boxes[i]), box_areas(boxes[j])), 1e-12
    )
    apart = (sources[i] != sources[j]) | (scenes[i] != scenes[j])  # a seam's boxes on either side of its border too
    duplicate = apart & (labels[i] == labels[j])
    duplicate &= (pair_ious(boxes[i], boxes[j]) > iou) | (inside >= containment)
    return greedy_nms(frame["score"].to_numpy(dtype=np.float64), i[duplicate], j[duplicate])


def merge_project(job: Mapping[str, Any]) -> str:
    """Write the project's detections (GeoParquet and GeoPackage); a line for the log."""
    crs, merge = job["crs"], job["merge"]
    ownership = ownership_of(job["sources"], crs)
    frames = [owned_detections(source, crs, ownership) for source in job["sources"]]
    present = [f for f in frames if len(f)] or frames[:1]
    frame = gpd.GeoDataFrame(pd.concat(present, ignore_index=True), geometry="geometry", crs=crs)
    keep = cross_source_duplicates(frame, job["project"]["iou_threshold"], merge["containment_threshold"])
    merged = frame[keep].sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
    outputs = job["outputs"]
    write_geoparquet(merged, outputs["parquet"])
    write_gpkg(merged, outputs["gpkg"], layer="detections")
    seams = sum(is_seam(source["name"]) for source in job["sources"])
    found = sum(len(f) for f in frames)
    return (
        f"{len(merged)} detections from {len(job['sources']) - seams} scenes and {seams} seams "
        f"({found} owned, {found - len(merged)} duplicates across sources) -> {outputs['parquet']}"
    )
