"""What the tasks that find objects share (detection's boxes, instances' crowns), whatever an object's shape.

- across tile overlaps: which objects are *cut* by an inner tile edge, and greedy NMS over a sparse list of
  suppressing pairs (never all pairs);
- against ground truth: greedy one-to-one matching in descending score order over a sparse list of candidate
  pairs and their IoUs, precision/recall/F1 and COCO's interpolated AP, class by class;
- rank files written (atomically) and a scene's read as one frame, the objects on valid pixels, merged across
  tiles by the task's merge;
- a scene's scores as JSON, a merged layer's counts by label.

The pairs and their IoUs are the task's (box IoU, polygon IoU); the merge and the scores here are numpy over those
arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import geopandas as gpd
import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
from geopandas.io.arrow import _geopandas_to_arrow

from rasterscale.atomic import atomic_path, write_json
from rasterscale.grid.manifest import read_manifest
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.raster.imagery import ImageSpec, on_data, read_spec
from rasterscale.raster.remote import file_name, shown

# (prediction indexes, ground-truth indexes, IoU threshold) -> the ground-truth index each prediction is matched
# to (-1: none); indexes into the caller's arrays
Matcher = Callable[[np.ndarray, np.ndarray, float], np.ndarray]

BOX_COLUMNS = ["px_xmin", "px_ymin", "px_xmax", "px_ymax"]  # an object's box in raster pixels, in every frame


class CrossTileMerge(Protocol):
    """A task's merge of a scene's objects across tile overlaps: one row per object, sorted by score."""

    def __call__(
        self,
        objects: gpd.GeoDataFrame,
        manifest: gpd.GeoDataFrame,
        raster_width: int,
        raster_height: int,
        /,
        iou_threshold: float,
        edge_tolerance: float,
        containment_threshold: float,
    ) -> gpd.GeoDataFrame: ...


def cut_by_inner_edge(
    boxes: np.ndarray, windows: np.ndarray, raster_width: int, raster_height: int, tolerance: float
) -> np.ndarray:
    """True for boxes touching an edge of their tile that is not the raster's edge (the object may go on)."""
    col, row, width, height = (windows[:, k] for k in range(4))
    left = (col > 0) & (boxes[:, 0] <= col + tolerance)
    top = (row > 0) & (boxes[:, 1] <= row + tolerance)
    right = (col + width < raster_width) & (boxes[:, 2] >= col + width - tolerance)
    bottom = (row + height < raster_height) & (boxes[:, 3] >= row + height - tolerance)
    return left | top | right | bottom


def greedy_nms(scores: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Keep-mask of greedy NMS given the suppressing pairs (i, j): a box is dropped when a kept box of higher
    score (ties: lower index) suppresses it, as in torchvision's NMS.

    Decided in rounds over the sparse pair list instead of box by box: each round suppresses the boxes that a
    kept box suppresses and keeps those whose higher-scoring neighbours are all suppressed. The best undecided
    box is always decided, so the rounds end; they are as many as the longest chain of overlaps (a handful).
    """
    n = len(scores)
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((np.arange(n), -np.asarray(scores)))] = np.arange(n)
    first = rank[i] < rank[j]
    high, low = np.where(first, i, j), np.where(first, j, i)
    state = np.zeros(n, dtype=np.int8)  # 0 undecided, 1 kept, -1 suppressed
    while True:
        pending = state[low] == 0
        high, low = high[pending], low[pending]
        state[low[state[high] == 1]] = -1
        blocked = np.zeros(n, dtype=bool)
        blocked[low[state[high] == 0]] = True
        state[(state == 0) & ~blocked] = 1
        if not blocked.any():
            return state == 1


def greedy_match(
    pred_idx: np.ndarray,
    gt_idx: np.ndarray,
    ious: np.ndarray,
    pred_scores: np.ndarray,
    n_ground_truth: int,
    iou_threshold: float,
) -> np.ndarray:
    """The ground-truth index each prediction is matched to (-1: none), one-to-one and greedy by score: each
    prediction, best first, takes the unmatched ground truth it overlaps most, if that IoU reaches the threshold.
    ``pred_idx``, ``gt_idx``, ``ious``: the candidate pairs (those that overlap at all) and their IoUs."""
    matched = np.full(len(pred_scores), -1, dtype=np.int64)
    good = ious >= iou_threshold
    pred_idx, gt_idx, ious = pred_idx[good], gt_idx[good], ious[good]
    if len(pred_idx) == 0:
        return matched
    rank = np.empty(len(pred_scores), dtype=np.int64)
    rank[np.argsort(-np.asarray(pred_scores), kind="stable")] = np.arange(len(pred_scores))
    # candidates ordered by prediction rank, then by IoU (best first)
    order = np.lexsort((-ious, rank[pred_idx]))
    gt_taken = np.zeros(n_ground_truth, dtype=bool)
    for p, g in zip(pred_idx[order].tolist(), gt_idx[order].tolist(), strict=True):
        if matched[p] < 0 and not gt_taken[g]:
            matched[p] = g
            gt_taken[g] = True
    return matched


def average_precision(scores: np.ndarray, true_positive: np.ndarray, n_ground_truth: int) -> float:
    """COCO-style 101-point interpolated average precision."""
    if n_ground_truth == 0:
        return float("nan")
    order = np.argsort(-np.asarray(scores), kind="stable")
    tp = np.asarray(true_positive, dtype=np.float64)[order]
    cum_tp = np.cumsum(tp)
    cum_fp = np.cumsum(1.0 - tp)
    recall = cum_tp / n_ground_truth
    precision = cum_tp / np.maximum(cum_tp + cum_fp, np.finfo(np.float64).eps)
    # precision envelope (monotonically decreasing from the right)
    envelope = np.maximum.accumulate(precision[::-1])[::-1] if len(precision) else precision
    thresholds = np.linspace(0.0, 1.0, 101)
    positions = np.searchsorted(recall, thresholds, side="left")
    sampled = np.array([envelope[p] if p < len(envelope) else 0.0 for p in positions])
    return float(sampled.mean())


def precision_recall_f1(n_true_positive: int, n_predicted: int, n_ground_truth: int) -> tuple[float, float, float]:
    precision = n_true_positive / n_predicted if n_predicted else 0.0
    recall = n_true_positive / n_ground_truth if n_ground_truth else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def score_matches(
    match: Matcher,
    pred_scores: np.ndarray,
    pred_labels: np.ndarray,
    gt_labels: np.ndarray,
    iou_threshold: float,
    score_threshold: float,
) -> tuple[dict[str, Any], np.ndarray]:
    """Precision/recall/F1 at ``iou_threshold`` (predictions scoring >= ``score_threshold``) and mAP@0.5 (all
    predictions; the mean over the labels that have ground truth), labels matched class by class with ``match``.
    Also the ground-truth index each prediction scoring enough is matched to at ``iou_threshold`` (-1: none)."""
    pred_scores, pred_labels, gt_labels = np.asarray(pred_scores), np.asarray(pred_labels), np.asarray(gt_labels)
    kept = pred_scores >= score_threshold
    matched = np.full(len(pred_scores), -1, dtype=np.int64)
    aps = []
    for label in np.union1d(np.unique(gt_labels), np.unique(pred_labels)):
        in_pred, in_gt = pred_labels == label, np.flatnonzero(gt_labels == label)
        sel = np.flatnonzero(in_pred & kept)
        matched[sel] = match(sel, in_gt, iou_threshold)
        if len(in_gt):
            tp50 = match(np.flatnonzero(in_pred), in_gt, 0.5) >= 0
            aps.append(average_precision(pred_scores[in_pred], tp50, len(in_gt)))
    n_tp = int((matched >= 0).sum())
    precision, recall, f1 = precision_recall_f1(n_tp, int(kept.sum()), len(gt_labels))
    metrics = {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "map50": float(np.mean(aps)) if aps else 0.0,
        "iou_threshold": iou_threshold,
        "score_threshold": score_threshold,
        "true_positives": n_tp,
        "predictions": int(kept.sum()),
        "ground_truth": len(gt_labels),
    }
    return metrics, matched


def record_scores(metrics: dict[str, Any], raster_path: str | Path, json_path: str | Path) -> str:
    """Write a scene's scores, with the raster they are of, as JSON (atomically); the title of its quicklook."""
    metrics["scene_raster"] = shown(raster_path)
    write_json(metrics, json_path)
    return f"{file_name(raster_path)}: P={metrics['precision']:.2f} R={metrics['recall']:.2f} F1={metrics['f1']:.2f}"


def count_labels(path: str | Path, labels: Sequence[str]) -> dict[str, int]:
    """A merged layer's objects per label: each of ``labels`` (0 when it has none), then any other label the
    layer holds. Only its label column is read."""
    column = pq.read_table(path, columns=["label"]).column("label")
    found = {str(item["values"]): int(item["counts"]) for item in pc.value_counts(column).to_pylist()}
    return {**{label: found.pop(label, 0) for label in labels}, **found}


def write_objects_file(objects: gpd.GeoDataFrame, columns: Sequence[str], path: str | Path) -> None:
    """GeoParquet of objects in a rank file's ``columns``, atomically."""
    table = _geopandas_to_arrow(objects[list(columns)].reset_index(drop=True))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_rank_files(paths: Sequence[str | Path], empty: Callable[[Any], gpd.GeoDataFrame]) -> gpd.GeoDataFrame:
    """A scene's rank files (GeoParquet) as one frame; ``empty(crs)`` where none holds a row."""
    frames = [gpd.read_parquet(p) for p in paths]
    crs = next((f.crs for f in frames if f.crs is not None), None)
    non_empty = [f for f in frames if len(f)]
    objects = pd.concat(non_empty, ignore_index=True) if non_empty else empty(crs)
    return gpd.GeoDataFrame(objects, geometry="geometry", crs=crs)


def drop_masked(objects: gpd.GeoDataFrame, path: str | Path, spec: ImageSpec) -> gpd.GeoDataFrame:
    """The objects whose box (:data:`BOX_COLUMNS`) is centred on a valid pixel (a tile partly masked may still
    see an object in its fill)."""
    if spec.mask == "none" or not len(objects):
        return objects
    return objects[on_data(path, spec, objects[BOX_COLUMNS].to_numpy())]


def merge_rank_files(
    rank_files: Sequence[str | Path],
    manifest_path: str | Path,
    raster_path: str | Path,
    merge_cfg: Mapping[str, float],
    empty: Callable[[Any], gpd.GeoDataFrame],
    merge: CrossTileMerge,
) -> tuple[gpd.GeoDataFrame, RasterInfo]:
    """A scene's rank files (their records already checked: :mod:`rasterscale.predict.rankfiles`), the objects on
    valid pixels, merged across tile overlaps with ``merge.*``; the merged frame and the scene's raster."""
    manifest = read_manifest(manifest_path)
    raster = check_raster(raster_path)
    objects = drop_masked(read_rank_files(rank_files, empty), raster_path, read_spec(manifest_path))
    merged = merge(
        objects,
        manifest,
        raster.width,
        raster.height,
        iou_threshold=merge_cfg["iou_threshold"],
        edge_tolerance=merge_cfg["edge_tolerance"],
        containment_threshold=merge_cfg["containment_threshold"],
    )
    return merged, raster
