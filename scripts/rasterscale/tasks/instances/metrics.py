"""Instances' scores against ground-truth crowns: precision, recall and F1 at a mask IoU, and mask AP@0.5.

As detection's scores (:mod:`rasterscale.tasks.detectors.metrics`: greedy one-to-one matching by score, class by
class; COCO's 101-point AP), with the IoU of polygons (the masks') instead of boxes. Candidate pairs come from an
STRtree over the polygons' envelopes; their intersections are computed in one vectorised call.

Crowns at tile edges are scored apart too: a crown is *at an edge* when it crosses an inner edge line of a tile
(a tile edge that is not on the raster's edge, as a segment of that tile's side): the crowns a tile saw cut.
Ground truth splits recall; a prediction counts where its matched ground truth is, an unmatched one where it lies
itself, which splits precision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import shapely

from rasterscale.grid.manifest import read_manifest
from rasterscale.raster.headers import check_raster
from rasterscale.tasks.detectors.metrics import Matcher, Shapes, evaluate_objects, greedy_match, write_scores
from rasterscale.tasks.instances.polygons import ious_of, overlap_areas, polygon_pairs, to_pixels
from rasterscale.tasks.instances.quicklook import render_instances_quicklook
from rasterscale.tasks.labels import label_indexes


def polygons_of(polygons: Any) -> np.ndarray:
    """Polygons as one flat object array."""
    return np.asarray(polygons, dtype=object).reshape(-1)


def polygon_matcher(pred_polygons: np.ndarray, pred_scores: np.ndarray, gt_polygons: np.ndarray) -> Matcher:
    """Matching of predictions (by index) to ground truth (by index) by polygon IoU, greedy by score."""
    pred_areas, gt_areas = shapely.area(pred_polygons), shapely.area(gt_polygons)

    def match(pred: np.ndarray, gt: np.ndarray, iou_threshold: float) -> np.ndarray:
        found = np.full(len(pred), -1, dtype=np.int64)
        p, g = polygon_pairs(pred_polygons[pred], gt_polygons[gt])  # indexes into pred and gt
        inter = overlap_areas(pred_polygons[pred[p]], gt_polygons[gt[g]])
        ious = ious_of(inter, pred_areas[pred[p]], gt_areas[gt[g]])
        local = greedy_match(p, g, ious, pred_scores[pred], len(gt), iou_threshold)
        found[local >= 0] = gt[local[local >= 0]]
        return found

    return match


POLYGONS = Shapes(polygons_of, polygon_matcher, iou_threshold=0.5)  # a match at mask IoU 0.5 unless told (COCO's)

# (pred_polygons, pred_scores, pred_labels, gt_polygons, gt_labels, iou_threshold=0.5, score_threshold=0.0,
# gt_at_edge=None, pred_at_edge=None) -> the scores: precision/recall/F1 at a mask (polygon) IoU of iou_threshold
# (predictions scoring >= score_threshold) and mask AP@0.5 (map50); with gt_at_edge and pred_at_edge
# (crosses_inner_edges), the same scores of the crowns at tile edges (edge) and of the others (interior)
evaluate_instances = partial(evaluate_objects, POLYGONS)


def inner_edge_lines(windows: np.ndarray, raster_width: int, raster_height: int) -> np.ndarray:
    """The sides of tiles (col_off, row_off, width, height in pixels) that are not on the raster's edge, as
    line segments in pixel coordinates, each once."""
    col, row, width, height = (np.asarray(windows[:, k], dtype=np.float64) for k in range(4))
    right, bottom = col + width, row + height
    sides = [
        np.stack([col, row, col, bottom], axis=1)[col > 0],  # left
        np.stack([right, row, right, bottom], axis=1)[right < raster_width],  # right
        np.stack([col, row, right, row], axis=1)[row > 0],  # top
        np.stack([col, bottom, right, bottom], axis=1)[bottom < raster_height],  # bottom
    ]
    segments = np.unique(np.concatenate(sides), axis=0)
    return shapely.linestrings(segments.reshape(-1, 2, 2))


def crosses_inner_edges(polygons: np.ndarray, windows: np.ndarray, raster_width: int, raster_height: int) -> np.ndarray:
    """True for each polygon (pixel coordinates) that crosses an inner edge line of a tile (its interior is on
    both sides of it)."""
    polygons = polygons_of(polygons)
    at_edge = np.zeros(len(polygons), dtype=bool)
    lines = inner_edge_lines(np.asarray(windows), raster_width, raster_height)
    if len(polygons) and len(lines):
        index, _ = shapely.STRtree(lines).query(polygons, predicate="crosses")
        at_edge[index] = True
    return at_edge


def evaluate_scene(
    crowns_path: str | Path,
    raster_path: str | Path,
    truth_polygons: np.ndarray,
    truth_labels: np.ndarray,
    labels: Sequence[str],
    thresholds: Mapping[str, float],
    json_path: str | Path,
    quicklook_path: str | Path,
    manifest_path: str | Path | None = None,
) -> dict[str, Any]:
    """Score a scene's layer of crowns against ground truth (polygons in the raster's pixels, 0-based indexes into
    ``labels``) at ``thresholds`` (``iou_threshold``: of their masks, ``score_threshold``); write the JSON
    (atomically) and the quicklook. With the scene's tile manifest, the scores of the crowns at tile edges and of the
    others too."""
    import geopandas as gpd

    raster = check_raster(raster_path)
    crowns = gpd.read_parquet(crowns_path)
    predicted = to_pixels(np.asarray(crowns.geometry.array, dtype=object), raster.transform)
    truth_polygons = polygons_of(truth_polygons)
    edges: dict[str, np.ndarray] = {}
    if manifest_path is not None:
        windows = read_manifest(manifest_path)[["col_off", "row_off", "width", "height"]].to_numpy()
        edges["gt_at_edge"] = crosses_inner_edges(truth_polygons, windows, raster.width, raster.height)
        edges["pred_at_edge"] = crosses_inner_edges(predicted, windows, raster.width, raster.height)
    metrics = evaluate_instances(
        predicted,
        crowns["score"].to_numpy(),
        label_indexes(str(crowns_path), crowns["label"].astype(str).to_numpy(), list(labels)),
        truth_polygons,
        np.asarray(truth_labels),
        iou_threshold=thresholds["iou_threshold"],
        score_threshold=thresholds["score_threshold"],
        **edges,
    )
    title = write_scores(metrics, raster_path, json_path)
    kept = crowns["score"].to_numpy() >= thresholds["score_threshold"]
    if "edge" in metrics:
        title += f" (F1 at tile edges {metrics['edge']['f1']:.2f}, inside {metrics['interior']['f1']:.2f})"
    render_instances_quicklook(raster_path, predicted[kept], truth_polygons, quicklook_path, title=title)
    return metrics
