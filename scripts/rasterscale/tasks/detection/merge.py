"""Detection's merge: per-rank detection files into one layer, without the duplicates tile overlaps create.

Each prediction rank writes one GeoParquet file of its detections (boxes in raster pixels and as polygons in the
raster's CRS); which tiles it processed is in its record (:mod:`rasterscale.jobs.rankfiles`), checked before. The
merge removes the duplicates that tile overlaps create:

1. a box *cut* by an inner tile edge (an edge that is not the raster's) is dropped when most of it lies inside
   a whole box of the same label, which the neighbouring tile saw in full;
2. greedy NMS (torchvision's rule) then runs over the sparse list of intersecting pairs, found once with an
   STRtree, so that a million boxes cost seconds, not a quadratic NMS.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd

from rasterscale.raster.geo import box_areas, box_pairs, intersection_areas, pair_ious
from rasterscale.tasks.detectors.merge import (
    BOX_COLUMNS,
    SceneLayer,
    greedy_nms,
    merge_across_tiles,
    write_objects_file,
)
from rasterscale.tasks.detectors.merge import merge_scene as merge_objects

DETECTION_COLUMNS = ["tile_id", "label", "score", *BOX_COLUMNS, "geometry"]


def empty_detections(crs: object) -> gpd.GeoDataFrame:
    frame = pd.DataFrame(
        {
            "tile_id": pd.Series(dtype="int64"),
            "label": pd.Series(dtype="str"),
            "score": pd.Series(dtype="float32"),
            **{column: pd.Series(dtype="float64") for column in BOX_COLUMNS},
        }
    )
    return gpd.GeoDataFrame(frame, geometry=gpd.GeoSeries([], crs=crs), crs=crs)


def write_detections_file(detections: gpd.GeoDataFrame, path: str | Path) -> None:
    """GeoParquet of detections in the merge's columns (a rank's output), atomically."""
    write_objects_file(detections, DETECTION_COLUMNS, path)


def drop_contained_cut_boxes(
    boxes: np.ndarray,
    labels: np.ndarray,
    cut: np.ndarray,
    containment_threshold: float,
    pairs: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Keep-mask dropping cut boxes that lie mostly inside a whole box of the same label.

    ``pairs``: the intersecting pairs of ``boxes`` (:func:`box_pairs`), when already known.
    """
    keep = np.ones(len(boxes), dtype=bool)
    i, j = box_pairs(boxes) if pairs is None else pairs
    a = np.concatenate([i[cut[i] & ~cut[j]], j[cut[j] & ~cut[i]]])
    b = np.concatenate([j[cut[i] & ~cut[j]], i[cut[j] & ~cut[i]]])
    if len(a) == 0:
        return keep
    same = labels[a] == labels[b]
    inside = intersection_areas(boxes[a], boxes[b]) / np.maximum(box_areas(boxes[a]), 1e-9)
    keep[a[same & (inside >= containment_threshold)]] = False
    return keep


def cross_tile_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray,
    iou_threshold: float,
    pairs: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Indices kept by greedy NMS per label, over the pairs of intersecting boxes (never all pairs)."""
    i, j = box_pairs(boxes) if pairs is None else pairs
    suppressing = (labels[i] == labels[j]) & (pair_ious(boxes[i], boxes[j]) > iou_threshold)
    return np.flatnonzero(greedy_nms(np.asarray(scores, dtype=np.float64), i[suppressing], j[suppressing]))


def keep_detections(
    detections: gpd.GeoDataFrame, boxes: np.ndarray, cut: np.ndarray, iou_threshold: float, containment_threshold: float
) -> np.ndarray:
    """The indexes of the detections kept across tile overlaps (steps 1 and 2 of the module docstring)."""
    labels = pd.factorize(detections["label"])[0]
    scores = detections["score"].to_numpy(dtype=np.float64)
    i, j = box_pairs(boxes)  # once: both steps only look at intersecting boxes
    keep = drop_contained_cut_boxes(boxes, labels, cut, containment_threshold, (i, j))
    both = keep[i] & keep[j]
    local = np.cumsum(keep) - 1
    kept = np.flatnonzero(keep)
    pairs = (local[i[both]], local[j[both]])
    return kept[cross_tile_nms(boxes[kept], scores[kept], labels[kept], iou_threshold, pairs)]


# (detections, manifest, raster width, raster height, iou_threshold, edge_tolerance, containment_threshold) -> one
# layer without the duplicates created by tile overlaps, sorted by score
merge_detections = partial(merge_across_tiles, keep_detections)


def in_crs(merged: gpd.GeoDataFrame, crs: object) -> gpd.GeoDataFrame:
    """The merged detections as the scene's layer: its rows, in the raster's CRS."""
    return merged.set_crs(crs, allow_override=True)


DETECTIONS = SceneLayer(empty_detections, merge_detections, in_crs, "detections")

# (rank files, tile manifest, raster, GeoPackage, GeoParquet, the merge section) -> the scene's detections, written
# (their records already checked: rasterscale.jobs.rankfiles)
merge_scene = partial(merge_objects, DETECTIONS)
