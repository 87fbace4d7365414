"""Detection scores against ground truth: precision, recall and F1 at an IoU threshold, and mAP@0.5.

Matching is greedy and one-to-one in descending score order (as in COCO and DeepForest): each prediction takes
the unmatched ground-truth box it overlaps most, if that IoU reaches the threshold. AP uses COCO's 101-point
interpolated precision-recall curve. Candidate pairs come from an STRtree, so large scenes stay cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rasterscale.atomic import write_json
from rasterscale.raster.geo import box_pairs, pair_ious
from rasterscale.raster.headers import check_raster
from rasterscale.raster.remote import file_name, shown
from rasterscale.tasks.detection.annotations import read_annotations
from rasterscale.tasks.detection.merge import BOX_COLUMNS
from rasterscale.tasks.detection.quicklook import render_quicklook
from rasterscale.tasks.labels import label_indexes


def match_detections(
    pred_boxes: np.ndarray, pred_scores: np.ndarray, gt_boxes: np.ndarray, iou_threshold: float
) -> np.ndarray:
    """True for each prediction matched to a ground-truth box (one-to-one, greedy by score)."""
    pred_boxes = np.asarray(pred_boxes, dtype=np.float64).reshape(-1, 4)
    gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
    matched = np.zeros(len(pred_boxes), dtype=bool)
    pred_idx, gt_idx = box_pairs(pred_boxes, gt_boxes)
    ious = pair_ious(pred_boxes[pred_idx], gt_boxes[gt_idx])
    good = ious >= iou_threshold
    pred_idx, gt_idx, ious = pred_idx[good], gt_idx[good], ious[good]
    if len(pred_idx) == 0:
        return matched
    rank = np.empty(len(pred_boxes), dtype=np.int64)
    rank[np.argsort(-np.asarray(pred_scores), kind="stable")] = np.arange(len(pred_boxes))
    # candidates ordered by prediction rank, then by IoU (best first)
    order = np.lexsort((-ious, rank[pred_idx]))
    gt_taken = np.zeros(len(gt_boxes), dtype=bool)
    for p, g in zip(pred_idx[order], gt_idx[order], strict=True):
        if not matched[p] and not gt_taken[g]:
            matched[p] = True
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


def evaluate_detections(
    pred_boxes: np.ndarray,
    pred_scores: np.ndarray,
    pred_labels: np.ndarray,
    gt_boxes: np.ndarray,
    gt_labels: np.ndarray,
    iou_threshold: float = 0.4,
    score_threshold: float = 0.0,
) -> dict[str, Any]:
    """Precision/recall/F1 at ``iou_threshold`` (predictions scoring >= ``score_threshold``), and mAP@0.5
    (all predictions), with labels matched class by class."""
    pred_boxes = np.asarray(pred_boxes, dtype=np.float64).reshape(-1, 4)
    pred_scores, pred_labels = np.asarray(pred_scores), np.asarray(pred_labels)
    gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
    gt_labels = np.asarray(gt_labels)
    kept = pred_scores >= score_threshold
    n_tp = 0
    aps = []
    for label in np.union1d(np.unique(gt_labels), np.unique(pred_labels)):
        in_pred, in_gt = pred_labels == label, gt_labels == label
        sel = in_pred & kept
        n_tp += int(match_detections(pred_boxes[sel], pred_scores[sel], gt_boxes[in_gt], iou_threshold).sum())
        if in_gt.any():
            tp50 = match_detections(pred_boxes[in_pred], pred_scores[in_pred], gt_boxes[in_gt], 0.5)
            aps.append(average_precision(pred_scores[in_pred], tp50, int(in_gt.sum())))
    precision, recall, f1 = precision_recall_f1(n_tp, int(kept.sum()), len(gt_boxes))
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "map50": float(np.mean(aps)) if aps else 0.0,
        "iou_threshold": iou_threshold,
        "score_threshold": score_threshold,
        "true_positives": n_tp,
        "predictions": int(kept.sum()),
        "ground_truth": len(gt_boxes),
    }


def evaluate_scene(
    detections_path: str | Path,
    raster_path: str | Path,
    annotations_path: str | Path,
    labels: list[str],
    label_column: str | None,
    evaluate_cfg: dict[str, float],
    json_path: str | Path,
    quicklook_path: str | Path,
    image_path: str | None = None,
) -> dict[str, Any]:
    """Score a merged detection layer against a scene's annotations; write the JSON and the quicklook.
    ``image_path``: the scene's image name in CSV/VOC annotations (default: the raster's file name)."""
    import geopandas as gpd

    raster = check_raster(raster_path)
    truth = read_annotations(annotations_path, raster, labels, label_column, image_path)
    detections = gpd.read_parquet(detections_path)
    metrics = evaluate_detections(
        detections[BOX_COLUMNS].to_numpy(dtype=np.float64),
        detections["score"].to_numpy(),
        label_indexes(str(detections_path), detections["label"].astype(str).to_numpy(), labels),
        truth.boxes,
        truth.labels,
        iou_threshold=evaluate_cfg["iou_threshold"],
        score_threshold=evaluate_cfg["score_threshold"],
    )
    metrics["scene_raster"] = shown(raster_path)
    write_json(metrics, json_path)
    kept = detections["score"].to_numpy() >= evaluate_cfg["score_threshold"]
    title = f"{file_name(raster_path)}: P={metrics['precision']:.2f} R={metrics['recall']:.2f} F1={metrics['f1']:.2f}"
    render_quicklook(raster_path, detections[BOX_COLUMNS].to_numpy()[kept], truth.boxes, quicklook_path, title=title)
    return metrics
