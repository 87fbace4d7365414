"""The points task's scores against ground truth (torch-free): predicted points matched one to one to true points of
their own class within ``evaluate.point_distance`` metres (:func:`~rasterscale.tasks.pointmatching.match_points`: the
most pairs, then the least total distance), as precision, recall and F1 at ``evaluate.score_threshold``, overall and
per class, and by score threshold (the best F1 and an average precision); and the count's error in cells of
``evaluate.count_cell`` metres, as objects per hectare (as the project's summary raster maps them). A scene's
scores are written as JSON with a quicklook.

Points are compared in metres: a layer's pixel coordinates (``px_x``, ``px_y``: column, row) and the ground truth's
times the raster's pixel size (square pixels, in the CRS's linear unit converted to metres), x to the right and y
down from the raster's top-left corner (only distances matter).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from rasterscale.atomic import write_json
from rasterscale.errors import InputError
from rasterscale.raster.remote import file_name, open_raster, shown
from rasterscale.raster.summary import HECTARE
from rasterscale.tasks.detectors.metrics import precision_recall_f1
from rasterscale.tasks.labels import label_indexes
from rasterscale.tasks.pointmatching import match_points, square_pixel_size
from rasterscale.tasks.points.quicklook import render_points_quicklook

# the score thresholds of the precision-recall curve (``by_score``) and of its average precision
THRESHOLDS = tuple(round(0.05 * k, 2) for k in range(1, 20))
EDGE_TOLERANCE = 1e-9  # cells: a raster 20.000000001 cells wide is 20 whole cells


class TruePoints(Protocol):
    """A scene's true points (a :class:`~rasterscale.tasks.points.groundtruth.PointTruth`): ``xy`` (N, 2) float
    pixel (column, row) coordinates in the raster, ``labels`` (N,) int indexes into the label list."""

    @property
    def xy(self) -> np.ndarray: ...

    @property
    def labels(self) -> np.ndarray: ...


def _ratios(matched: int, predicted: int, true: int) -> dict[str, Any]:
    """Precision, recall and F1 (0.0 where there is nothing to count) with the counts they come of."""
    precision, recall, f1 = precision_recall_f1(matched, predicted, true)
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "matched": matched,
        "predicted": predicted,
        "true": true,
    }


def _label_array(values: np.ndarray, labels: Sequence[str], what: str) -> np.ndarray:
    """Label indexes as int64, each an index into ``labels``."""
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    wrong = array[(array < 0) | (array >= len(labels))]
    if wrong.size:
        raise ValueError(f"{what} label index {int(wrong[0])} is not one of the {len(labels)} labels")
    return array


def match_by_class(
    pred_xy: np.ndarray, pred_labels: np.ndarray, true_xy: np.ndarray, true_labels: np.ndarray, max_distance: float
) -> tuple[np.ndarray, np.ndarray]:
    """One-to-one matching within ``max_distance`` (:func:`match_points`) class by class: a prediction matches only a
    truth of its label. Returns the matched (predicted, true) indexes into the given arrays."""
    found_p, found_t = [np.array([], dtype=np.int64)], [np.array([], dtype=np.int64)]
    for label in np.intersect1d(pred_labels, true_labels):
        p, t = np.flatnonzero(pred_labels == label), np.flatnonzero(true_labels == label)
        mp, mt = match_points(pred_xy[p], true_xy[t], max_distance)
        found_p.append(p[mp])
        found_t.append(t[mt])
    return np.concatenate(found_p), np.concatenate(found_t)


def step_average_precision(recall: np.ndarray, precision: np.ndarray) -> float:
    """The area under a precision-recall curve by the step rule (scikit-learn's average precision): the sum of
    ``(R_k - R_(k-1)) * P_k`` over its points in ascending recall, from ``R_0 = 0``. The points in order of falling
    score threshold (recall ties keep that order: the first point of a recall takes its step)."""
    order = np.argsort(np.asarray(recall, dtype=np.float64), kind="stable")
    r, p = np.asarray(recall, dtype=np.float64)[order], np.asarray(precision, dtype=np.float64)[order]
    return float(np.sum(np.diff(np.r_[0.0, r]) * p))


def score_curve(
    pred_xy: np.ndarray,
    pred_scores: np.ndarray,
    pred_labels: np.ndarray,
    true_xy: np.ndarray,
    true_labels: np.ndarray,
    max_distance: float,
    score_threshold: float,
) -> dict[str, Any]:
    """All classes' precision, recall and F1 at each of :data:`THRESHOLDS` and ``score_threshold`` (``thresholds``,
    ascending); the best F1 and its threshold (the highest of those tied; None when nothing ever matches); ``ap``,
    the step-rule area (:func:`step_average_precision`) under the curve of :data:`THRESHOLDS` alone, so that it does
    not depend on the configured threshold."""
    rows = []
    for threshold in sorted({*THRESHOLDS, float(score_threshold)}):
        kept = np.flatnonzero(pred_scores >= threshold)
        mp, _ = match_by_class(pred_xy[kept], pred_labels[kept], true_xy, true_labels, max_distance)
        rows.append({"threshold": threshold, **_ratios(int(mp.size), int(kept.size), len(true_xy))})
    best = max(rows, key=lambda row: (row["f1"], row["threshold"]))
    grid = [row for row in reversed(rows) if row["threshold"] in THRESHOLDS]  # falling threshold
    ap = step_average_precision(np.array([r["recall"] for r in grid]), np.array([r["precision"] for r in grid]))
    return {
        "thresholds": rows,
        "best_f1": best["f1"],
        "best_threshold": best["threshold"] if best["f1"] > 0 else None,
        "ap": ap,
        "ap_method": "step",
    }


def score_points(
    pred_xy: np.ndarray,
    pred_scores: np.ndarray,
    pred_labels: np.ndarray,
    true_xy: np.ndarray,
    true_labels: np.ndarray,
    labels: Sequence[str],
    max_distance: float,
    score_threshold: float,
) -> dict[str, Any]:
    """Predicted points (metres, their scores and label indexes) against true points (metres, label indexes): those
    scoring >= ``score_threshold`` matched one to one to true points of their class within ``max_distance`` metres
    (:func:`match_by_class`). Precision, recall, F1 and the counts (``matched``, ``predicted``, ``true``) of all
    classes; ``mean_distance_m`` of the matched pairs (None when none); ``per_class`` the same ratios and counts of
    each label by name; ``by_score`` the curve over score thresholds (:func:`score_curve`). A ratio with nothing to
    count is 0.0."""
    if not max_distance > 0:
        raise ValueError(f"max_distance must be > 0 metres, got {max_distance}")
    pred_xy = np.asarray(pred_xy, dtype=np.float64).reshape(-1, 2)
    true_xy = np.asarray(true_xy, dtype=np.float64).reshape(-1, 2)
    pred_scores = np.asarray(pred_scores, dtype=np.float64).reshape(-1)
    pred_labels = _label_array(pred_labels, labels, "a predicted point's")
    true_labels = _label_array(true_labels, labels, "a true point's")
    if not len(pred_xy) == len(pred_scores) == len(pred_labels) or len(true_xy) != len(true_labels):
        raise ValueError("points, their scores and their labels must be as many")
    kept = np.flatnonzero(pred_scores >= score_threshold)
    mp, mt = match_by_class(pred_xy[kept], pred_labels[kept], true_xy, true_labels, max_distance)
    distances = np.hypot(*(pred_xy[kept][mp] - true_xy[mt]).T)
    per_class = {}
    for index, name in enumerate(labels):
        matched = int((true_labels[mt] == index).sum())
        predicted = int((pred_labels[kept] == index).sum())
        per_class[name] = _ratios(matched, predicted, int((true_labels == index).sum()))
    return {
        **_ratios(int(mp.size), int(kept.size), len(true_xy)),
        "mean_distance_m": float(distances.mean()) if distances.size else None,
        "per_class": per_class,
        "by_score": score_curve(pred_xy, pred_scores, pred_labels, true_xy, true_labels, max_distance, score_threshold),
    }


def _cells_along(extent: float, cell: float) -> tuple[int, float]:
    """Whole cells along a side of ``extent`` metres and their size: the last partial cell left out, unless the side
    is shorter than one cell (then one cell, the side)."""
    count = math.floor(extent / cell + EDGE_TOLERANCE)
    return (count, cell) if count >= 1 else (1, extent)


def cell_counts(xy: np.ndarray, cols: int, rows: int, width: float, height: float) -> np.ndarray:
    """Points (metres from the top-left corner) counted in a grid of ``rows`` x ``cols`` cells of ``width`` x
    ``height`` metres; points outside the grid are not counted."""
    xy = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    col, row = np.floor(xy[:, 0] / width), np.floor(xy[:, 1] / height)
    inside = (col >= 0) & (col < cols) & (row >= 0) & (row < rows)
    flat = row[inside].astype(np.int64) * cols + col[inside].astype(np.int64)
    return np.bincount(flat, minlength=rows * cols).reshape(rows, cols)


def count_errors(
    pred_xy: np.ndarray,
    true_xy: np.ndarray,
    width_m: float,
    height_m: float,
    cell: float,
    valid: np.ndarray | None = None,
) -> dict[str, Any]:
    """The count's error, cell by cell: predicted and true points (metres from the raster's top-left corner) counted
    in cells of ``cell`` metres from that corner over a raster of ``width_m`` x ``height_m`` metres (the last partial
    row and column left out, unless the raster is smaller than one cell along a side: then one cell is the raster
    there), as objects per hectare. ``valid``: the cells to keep, a boolean (rows, cols) mask (None: all).

    Returns ``cells`` (kept), ``cell_m``, ``cell_area_ha``, ``mae_per_ha`` (mean |predicted - true| density),
    ``bias_per_ha`` (mean predicted - true), ``true_per_ha`` (mean true density), ``relative_mae`` (MAE over the mean
    true density) and ``total_error`` ((predicted - true) / true points over the kept cells); the means are 0.0 over
    no cell, the relative errors None without truth."""
    if not cell > 0:
        raise ValueError(f"cell must be > 0 metres, got {cell}")
    if not (width_m > 0 and height_m > 0):
        raise ValueError(f"the raster must have an area, got {width_m} x {height_m} m")
    cols, cell_w = _cells_along(width_m, cell)
    rows, cell_h = _cells_along(height_m, cell)
    keep = np.ones((rows, cols), dtype=bool)
    if valid is not None:
        if np.shape(valid) != (rows, cols):
            raise ValueError(f"valid must be a mask of {rows} x {cols} cells, got {np.shape(valid)}")
        keep = np.asarray(valid, dtype=bool)
    area_ha = cell_w * cell_h / HECTARE
    predicted = cell_counts(pred_xy, cols, rows, cell_w, cell_h)[keep]
    true = cell_counts(true_xy, cols, rows, cell_w, cell_h)[keep]
    difference = (predicted - true) / area_ha
    true_per_ha = float(true.mean() / area_ha) if true.size else 0.0
    mae = float(np.abs(difference).mean()) if difference.size else 0.0
    return {
        "cells": int(keep.sum()),
        "cell_m": float(cell),
        "cell_area_ha": float(area_ha),
        "mae_per_ha": mae,
        "bias_per_ha": float(difference.mean()) if difference.size else 0.0,
        "true_per_ha": true_per_ha,
        "relative_mae": mae / true_per_ha if true_per_ha > 0 else None,
        "total_error": float((predicted.sum() - true.sum()) / true.sum()) if true.sum() > 0 else None,
    }


def metres_per_pixel(src: Any) -> float:
    """A raster's (square) pixel size in metres: in its CRS's linear unit converted (a CRS in feet); a geographic
    CRS is refused (points are matched within metres)."""
    size = square_pixel_size(src)
    if src.crs is None:
        return size
    if src.crs.is_geographic:
        raise InputError(f"{shown(src.name)}: points are scored in metres: the raster needs a projected CRS")
    return size * float(src.crs.linear_units_factor[1])


def evaluate_points(
    points_parquet: str | Path,
    raster: str,
    truth: TruePoints,
    labels: Sequence[str],
    max_distance: float,
    score_threshold: float,
    cell: float,
    out: str | Path,
    quicklook: str | Path,
    image_path: str | None = None,
) -> dict[str, Any]:
    """Score a scene's merged layer of points (GeoParquet: ``label``, ``score``, ``px_x``, ``px_y``) against its true
    points (:class:`TruePoints`, in the raster's pixels): :func:`score_points` within ``max_distance`` metres at
    ``score_threshold``, and ``counts``, :func:`count_errors` of the points scoring that much in cells of ``cell``
    metres; with the ``labels``, ``point_distance_m``, ``score_threshold`` and ``scene_raster``. Writes the scores as
    JSON to ``out`` and the quicklook PNG (the points scoring that much and the true points over the raster) to
    ``quicklook``, each atomically, and returns the scores. ``image_path``: the scene's name in the quicklook's
    title (default: the raster's file name)."""
    with open_raster(raster) as src:
        pixel = metres_per_pixel(src)
        width_m, height_m = src.width * pixel, src.height * pixel
    frame = pd.read_parquet(points_parquet, columns=["label", "score", "px_x", "px_y"])
    pred_px = frame[["px_x", "px_y"]].to_numpy(dtype=np.float64).reshape(-1, 2)
    scores = frame["score"].to_numpy(dtype=np.float64)
    pred_labels = label_indexes(str(points_parquet), frame["label"].astype(str).to_numpy(), list(labels))
    true_px = np.asarray(truth.xy, dtype=np.float64).reshape(-1, 2)
    metrics = score_points(
        pred_px * pixel, scores, pred_labels, true_px * pixel, truth.labels, labels, max_distance, score_threshold
    )
    kept = scores >= score_threshold
    metrics["counts"] = count_errors(pred_px[kept] * pixel, true_px * pixel, width_m, height_m, cell)
    metrics.update(
        labels=list(labels),
        point_distance_m=float(max_distance),
        score_threshold=float(score_threshold),
        scene_raster=shown(raster),
    )
    write_json(metrics, out)
    title = f"{file_name(image_path or raster)}: {summarize(metrics)}"
    render_points_quicklook(raster, pred_px[kept], true_px, quicklook, title=title)
    return metrics


def summarize(metrics: Mapping[str, Any]) -> str:
    """A scene's scores in one line: precision, recall, F1 and AP, the count's total error (signed: over or under
    counting) and its MAE per hectare."""
    counts = metrics["counts"]
    total = counts["total_error"]
    error = f"{100 * total:+.1f}%" if total is not None else "n/a (no true points)"
    return (
        f"precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} f1={metrics['f1']:.3f} "
        f"ap={metrics['by_score']['ap']:.3f}; count error {error} (MAE {counts['mae_per_ha']:.1f} /ha)"
    )
