"""The scores against ground truth of the tasks that find objects (detection's boxes, instances' crowns), whatever an
object's shape: greedy one-to-one matching in descending score order over a sparse list of candidate pairs and
their IoUs (as in COCO and DeepForest), precision/recall/F1 and COCO's 101-point interpolated AP, class by class;
the same scores of the objects at tile edges and of the others; a scene's scores as JSON.

A task says how its objects are held and overlap (:class:`Shapes`: box IoU, polygon IoU); the scores here are
numpy over those arrays (:func:`evaluate_objects`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rasterscale.atomic import write_json
from rasterscale.raster.remote import file_name, shown

# (prediction indexes, ground-truth indexes, IoU threshold) -> the ground-truth index each prediction is matched
# to (-1: none); indexes into the caller's arrays
Matcher = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


@dataclass(frozen=True)
class Shapes:
    """How a task's objects are held and matched: ``array`` makes its shapes one array (boxes (N, 4), polygons
    (N,)); ``matcher(predicted, scores, truth)`` matches predictions to ground truth by the shapes' IoU, greedy by
    score; a match is at least ``iou_threshold`` IoU unless the caller says otherwise."""

    array: Callable[[Any], np.ndarray]
    matcher: Callable[[np.ndarray, np.ndarray, np.ndarray], Matcher]
    iou_threshold: float


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


def write_scores(metrics: dict[str, Any], raster_path: str | Path, json_path: str | Path) -> str:
    """Write a scene's scores, with the raster they are of, as JSON (atomically); the title of its quicklook."""
    metrics["scene_raster"] = shown(raster_path)
    write_json(metrics, json_path)
    return f"{file_name(raster_path)}: P={metrics['precision']:.2f} R={metrics['recall']:.2f} F1={metrics['f1']:.2f}"


def split_scores(
    matched: np.ndarray, kept: np.ndarray, gt_at_edge: np.ndarray, pred_at_edge: np.ndarray
) -> dict[str, dict[str, Any]]:
    """Precision/recall/F1 of the objects at tile edges (``edge``) and of the others (``interior``): ground truth
    splits recall; a prediction counts where its matched ground truth is, an unmatched one where it lies itself,
    which splits precision. ``matched``: the ground-truth index of each prediction (-1: none), ``kept``: the
    predictions scoring enough."""
    where = np.where(matched >= 0, gt_at_edge[np.maximum(matched, 0)], pred_at_edge)
    split = {}
    for name, at_edge in (("edge", True), ("interior", False)):
        predictions = int((kept & (where == at_edge)).sum())
        tp = int(((matched >= 0) & (where == at_edge)).sum())
        truth = int((gt_at_edge == at_edge).sum())
        precision, recall, f1 = precision_recall_f1(tp, predictions, truth)
        split[name] = {
            "precision": precision,
            "recall": recall,
            "f1": f1,
            "true_positives": tp,
            "predictions": predictions,
            "ground_truth": truth,
        }
    return split


def evaluate_objects(
    shapes: Shapes,
    predicted: Any,
    pred_scores: np.ndarray,
    pred_labels: np.ndarray,
    truth: Any,
    gt_labels: np.ndarray,
    iou_threshold: float | None = None,
    score_threshold: float = 0.0,
    gt_at_edge: np.ndarray | None = None,
    pred_at_edge: np.ndarray | None = None,
) -> dict[str, Any]:
    """Precision/recall/F1 at ``iou_threshold`` (``shapes.iou_threshold`` when None; predictions scoring >=
    ``score_threshold``) and AP@0.5 (``map50``: all predictions, the mean over the labels with ground truth),
    labels matched class by class. Predictions and ground truth in the same coordinates (pixels or a CRS: IoU is
    the same under an affine map). With ``gt_at_edge`` and ``pred_at_edge`` (which objects cross an inner tile
    edge), the same scores of the objects at tile edges and of the others (:func:`split_scores`)."""
    predicted, truth = shapes.array(predicted), shapes.array(truth)
    pred_scores = np.asarray(pred_scores).reshape(-1)
    iou = shapes.iou_threshold if iou_threshold is None else iou_threshold
    match = shapes.matcher(predicted, pred_scores, truth)
    metrics, matched = score_matches(
        match, pred_scores, np.asarray(pred_labels), np.asarray(gt_labels), iou, score_threshold
    )
    if gt_at_edge is not None and pred_at_edge is not None:
        kept = pred_scores >= score_threshold
        metrics.update(split_scores(matched, kept, np.asarray(gt_at_edge), np.asarray(pred_at_edge)))
    return metrics
