"""Detection's merge: per-rank detection files into one layer, without the duplicates tile overlaps create.

Each prediction rank writes one GeoParquet file of its detections (boxes in raster pixels and as polygons in the
raster's CRS); which tiles it processed is in its record (:mod:`rasterscale.predict.rankfiles`), checked before. The
merge removes the duplicates that tile overlaps create:

1. a box *cut* by an inner tile edge (an edge that is not the raster's) is dropped when most of it lies inside
   a whole box of the same label, which the neighbouring tile saw in full;
2. greedy NMS (torchvision's rule) then runs over the sparse list of intersecting pairs, found once with an
   STRtree, so that a million boxes cost seconds, not a quadratic NMS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd

from rasterscale.atomic import write_geoparquet, write_gpkg
from rasterscale.raster.geo import box_areas, box_pairs, intersection_areas, pair_ious
from rasterscale.tasks.objects import (
    BOX_COLUMNS,
    count_labels,
    cut_by_inner_edge,
    greedy_nms,
    merge_rank_files,
    write_objects_file,
)

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


def merge_detections(
    detections: gpd.GeoDataFrame,
    manifest: gpd.GeoDataFrame,
    raster_width: int,
    raster_height: int,
    iou_threshold: float,
    edge_tolerance: float,
    containment_threshold: float,
) -> gpd.GeoDataFrame:
    """One layer without the duplicates created by tile overlaps, sorted by score."""
    if len(detections) == 0:
        return detections.reset_index(drop=True)
    windows = manifest.set_index("tile_id").loc[detections["tile_id"], ["col_off", "row_off", "width", "height"]]
    boxes = detections[BOX_COLUMNS].to_numpy(dtype=np.float64)
    labels = pd.factorize(detections["label"])[0]
    scores = detections["score"].to_numpy(dtype=np.float64)
    cut = cut_by_inner_edge(boxes, windows.to_numpy(), raster_width, raster_height, edge_tolerance)
    i, j = box_pairs(boxes)  # once: both steps only look at intersecting boxes
    keep = drop_contained_cut_boxes(boxes, labels, cut, containment_threshold, (i, j))
    both = keep[i] & keep[j]
    local = np.cumsum(keep) - 1
    keep = np.flatnonzero(keep)
    pairs = (local[i[both]], local[j[both]])
    kept = keep[cross_tile_nms(boxes[keep], scores[keep], labels[keep], iou_threshold, pairs)]
    merged = detections.iloc[kept].sort_values("score", ascending=False, kind="stable")
    return merged.reset_index(drop=True)


def merge_scene(
    rank_files: Sequence[str | Path],
    manifest_path: str | Path,
    raster_path: str | Path,
    gpkg_path: str | Path,
    parquet_path: str | Path,
    merge_cfg: Mapping[str, float],
    layer: str = "detections",
) -> gpd.GeoDataFrame:
    """Merge a scene's rank detection files (their records already checked: :mod:`rasterscale.predict.rankfiles`) across
    tile overlaps; write GeoPackage and GeoParquet."""

    merged, raster = merge_rank_files(
        rank_files, manifest_path, raster_path, merge_cfg, empty_detections, merge_detections
    )
    merged = merged.set_crs(raster.crs, allow_override=True)
    write_gpkg(merged, gpkg_path, layer=layer)
    write_geoparquet(merged, parquet_path)
    return merged


# -- reading a merged layer back (the report) ------------------------------------------------------------------


def count_detections(path: str | Path, labels: Sequence[str]) -> dict[str, int]:
    """A merged layer's detections per label: each of ``labels`` (0 when it has none), then any other label the
    layer holds. Only its label column is read."""
    return count_labels(path, labels)


def scored_boxes(path: str | Path, min_score: float) -> np.ndarray:
    """A merged layer's boxes in raster pixels, (N, 4), of the detections scoring at least ``min_score``."""
    frame = pd.read_parquet(path, columns=[*BOX_COLUMNS, "score"])
    return frame.loc[frame["score"] >= min_score, BOX_COLUMNS].to_numpy(dtype=np.float64)
