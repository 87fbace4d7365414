"""Detection scores against ground truth: precision, recall and F1 at an IoU threshold, and mAP@0.5, by box IoU
(:mod:`rasterscale.tasks.detectors.metrics`).

Matching is greedy and one-to-one in descending score order (as in COCO and DeepForest): each prediction takes
the unmatched ground-truth box it overlaps most, if that IoU reaches the threshold. AP uses COCO's 101-point
interpolated precision-recall curve. Candidate pairs come from an STRtree, so large scenes stay cheap.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from rasterscale.raster.geo import box_pairs, pair_ious
from rasterscale.raster.headers import check_raster
from rasterscale.settings import EvaluateSettings
from rasterscale.tasks.detection.groundtruth import read_annotations
from rasterscale.tasks.detection.quicklook import render_detections_quicklook
from rasterscale.tasks.detectors.merge import BOX_COLUMNS
from rasterscale.tasks.detectors.metrics import Matcher, Shapes, evaluate_objects, greedy_match, write_scores
from rasterscale.tasks.detectors.metrics import average_precision as average_precision  # detection's API, shared
from rasterscale.tasks.detectors.metrics import precision_recall_f1 as precision_recall_f1
from rasterscale.tasks.labels import label_indexes


def boxes_of(boxes: Any) -> np.ndarray:
    """Boxes (xmin, ymin, xmax, ymax) as one (N, 4) float64 array."""
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4)


def box_matcher(pred_boxes: np.ndarray, pred_scores: np.ndarray, gt_boxes: np.ndarray) -> Matcher:
    """Matching of predictions (by index) to ground truth (by index) by box IoU, greedy by score."""

    def match(pred: np.ndarray, gt: np.ndarray, iou_threshold: float) -> np.ndarray:
        found = np.full(len(pred), -1, dtype=np.int64)
        pred_idx, gt_idx = box_pairs(pred_boxes[pred], gt_boxes[gt])
        ious = pair_ious(pred_boxes[pred][pred_idx], gt_boxes[gt][gt_idx])
        local = greedy_match(pred_idx, gt_idx, ious, pred_scores[pred], len(gt), iou_threshold)
        found[local >= 0] = gt[local[local >= 0]]
        return found

    return match


def match_detections(
    pred_boxes: np.ndarray, pred_scores: np.ndarray, gt_boxes: np.ndarray, iou_threshold: float
) -> np.ndarray:
    """True for each prediction matched to a ground-truth box (one-to-one, greedy by score)."""
    pred_boxes, gt_boxes = boxes_of(pred_boxes), boxes_of(gt_boxes)
    pred_idx, gt_idx = box_pairs(pred_boxes, gt_boxes)
    ious = pair_ious(pred_boxes[pred_idx], gt_boxes[gt_idx])
    return greedy_match(pred_idx, gt_idx, ious, np.asarray(pred_scores), len(gt_boxes), iou_threshold) >= 0


BOXES = Shapes(boxes_of, box_matcher, iou_threshold=0.4)  # a match at box IoU 0.4 unless told (DeepForest's)

# (pred_boxes, pred_scores, pred_labels, gt_boxes, gt_labels, iou_threshold=0.4, score_threshold=0.0) -> the scores:
# precision/recall/F1 at iou_threshold (predictions scoring >= score_threshold) and mAP@0.5 (all predictions)
evaluate_detections = partial(evaluate_objects, BOXES)


def evaluate_scene(
    detections_path: str | Path,
    raster_path: str | Path,
    annotations_path: str | Path,
    labels: list[str],
    label_column: str | None,
    evaluate: EvaluateSettings,
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
        iou_threshold=evaluate.iou_threshold,
        score_threshold=evaluate.score_threshold,
    )
    title = write_scores(metrics, raster_path, json_path)
    kept = detections["score"].to_numpy() >= evaluate.score_threshold
    render_detections_quicklook(
        raster_path, detections[BOX_COLUMNS].to_numpy()[kept], truth.boxes, quicklook_path, title=title
    )
    return metrics
