"""The points task's scores: one-to-one matching within a distance, class by class, at a score threshold and by
score (the best F1, the step-rule AP); the count's error per cell in objects per hectare; a scene's evaluation end
to end on a real GeoTIFF and GeoParquet (the JSON, the quicklook PNG) and its one-line summary.

Rasters are 200 x 200 pixels of 0.1 m (20 m x 20 m): in 10 m cells, four cells of 0.01 ha."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import geopandas as gpd
import numpy as np
import pytest
from PIL import Image

from conftest import UTM17N, write_raster
from rasterscale.errors import InputError
from rasterscale.tasks.points.metrics import THRESHOLDS, count_errors, evaluate_points, score_points, summarize
from rasterscale.tasks.points.quicklook import render_points_quicklook, scored_points

LABELS = ["tree", "snag"]
PIXEL = 0.1
X0, Y0 = 404000.0, 3285000.0  # conftest.write_raster's default transform: 0.1 m pixels from here
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Truth:
    """What the evaluation reads of a PointTruth: pixel (column, row) coordinates and label indexes."""

    xy: np.ndarray
    labels: np.ndarray


def points(*xy: tuple[float, float]) -> np.ndarray:
    return np.array(xy, dtype=np.float64).reshape(-1, 2)


def score(pred, scores, pred_labels, true, true_labels, max_distance=1.0, threshold=0.5):
    return score_points(
        points(*pred),
        np.asarray(scores, dtype=np.float64),
        np.asarray(pred_labels, dtype=np.int64),
        points(*true),
        np.asarray(true_labels, dtype=np.int64),
        LABELS,
        max_distance,
        threshold,
    )


def test_a_perfect_prediction_scores_one_everywhere():
    true = [(2.0, 3.0), (8.0, 1.0), (15.0, 15.0)]
    metrics = score(true, [0.9, 0.8, 0.99], [0, 0, 1], true, [0, 0, 1])
    assert (metrics["precision"], metrics["recall"], metrics["f1"]) == (1.0, 1.0, 1.0)
    assert (metrics["matched"], metrics["predicted"], metrics["true"]) == (3, 3, 3)
    assert metrics["mean_distance_m"] == 0.0
    assert metrics["per_class"]["tree"]["f1"] == metrics["per_class"]["snag"]["f1"] == 1.0
    assert metrics["by_score"]["ap"] == pytest.approx(1.0)
    assert metrics["by_score"]["best_f1"] == 1.0


def test_a_prediction_just_inside_the_distance_matches_and_one_just_outside_does_not():
    inside = score([(5.999, 5.0)], [0.9], [0], [(5.0, 5.0)], [0], max_distance=1.0)
    assert inside["matched"] == 1 and inside["mean_distance_m"] == pytest.approx(0.999)
    outside = score([(6.001, 5.0)], [0.9], [0], [(5.0, 5.0)], [0], max_distance=1.0)
    assert outside["matched"] == 0 and outside["mean_distance_m"] is None
    assert (outside["precision"], outside["recall"], outside["f1"]) == (0.0, 0.0, 0.0)


def test_a_prediction_of_the_wrong_class_matches_nothing():
    metrics = score([(5.0, 5.0)], [0.9], [1], [(5.0, 5.0)], [0])
    assert metrics["matched"] == 0 and metrics["f1"] == 0.0
    tree, snag = metrics["per_class"]["tree"], metrics["per_class"]["snag"]
    assert (tree["true"], tree["predicted"], tree["matched"], tree["recall"]) == (1, 0, 0, 0.0)
    assert (snag["true"], snag["predicted"], snag["matched"], snag["precision"]) == (0, 1, 0, 0.0)


def test_matching_is_one_to_one():
    metrics = score([(5.0, 5.2), (5.0, 4.7)], [0.9, 0.8], [0, 0], [(5.0, 5.0)], [0])
    assert (metrics["matched"], metrics["predicted"], metrics["true"]) == (1, 2, 1)
    assert (metrics["precision"], metrics["recall"]) == (0.5, 1.0)
    assert metrics["mean_distance_m"] == pytest.approx(0.2)  # the nearer of the two


def test_the_score_threshold_leaves_out_the_predictions_below_it():
    true = [(1.0, 1.0), (9.0, 9.0)]
    metrics = score(true, [0.9, 0.3], [0, 0], true, [0, 0], threshold=0.5)
    assert (metrics["matched"], metrics["predicted"], metrics["precision"], metrics["recall"]) == (1, 1, 1.0, 0.5)
    low = score(true, [0.9, 0.3], [0, 0], true, [0, 0], threshold=0.3)  # at the threshold: kept
    assert (low["matched"], low["predicted"]) == (2, 2)


def test_by_score_recall_grows_as_the_threshold_falls_and_the_best_f1_is_at_least_the_threshold_s():
    rng = np.random.default_rng(7)
    true = rng.uniform(0, 50, size=(60, 2))
    true_labels = rng.integers(0, 2, size=60)
    pred = np.concatenate([true[:45] + rng.normal(0, 0.3, size=(45, 2)), rng.uniform(0, 50, size=(30, 2))])
    pred_labels = np.concatenate([true_labels[:45], rng.integers(0, 2, size=30)])
    scores = np.concatenate([rng.uniform(0.3, 1.0, size=45), rng.uniform(0.0, 0.7, size=30)])
    metrics = score_points(pred, scores, pred_labels, true, true_labels, LABELS, 1.0, 0.42)
    curve = metrics["by_score"]
    thresholds = [row["threshold"] for row in curve["thresholds"]]
    assert thresholds == sorted([*THRESHOLDS, 0.42])
    recalls = [row["recall"] for row in curve["thresholds"]]  # thresholds ascending: recall falls or stays
    assert all(a >= b for a, b in itertools.pairwise(recalls))
    assert recalls[0] > recalls[-1]
    at_threshold = curve["thresholds"][thresholds.index(0.42)]
    assert (at_threshold["precision"], at_threshold["recall"], at_threshold["f1"]) == (
        metrics["precision"],
        metrics["recall"],
        metrics["f1"],
    )
    assert curve["best_f1"] >= metrics["f1"] > 0
    assert curve["best_f1"] == max(row["f1"] for row in curve["thresholds"])
    assert curve["best_threshold"] in thresholds
    assert 0.0 < curve["ap"] <= 1.0 and curve["ap_method"] == "step"


@pytest.mark.parametrize(
    ("pred", "true"),
    [([], [(1.0, 1.0)]), ([(1.0, 1.0)], []), ([], [])],
    ids=["no prediction", "no truth", "neither"],
)
def test_nothing_to_count_gives_zero_ratios(pred, true):
    metrics = score(pred, [0.9] * len(pred), [0] * len(pred), true, [0] * len(true))
    assert (metrics["precision"], metrics["recall"], metrics["f1"], metrics["matched"]) == (0.0, 0.0, 0.0, 0)
    assert metrics["mean_distance_m"] is None
    assert all(row["f1"] == 0.0 for row in metrics["by_score"]["thresholds"])
    assert (metrics["by_score"]["ap"], metrics["by_score"]["best_f1"]) == (0.0, 0.0)
    assert metrics["by_score"]["best_threshold"] is None
    assert all(cls["precision"] == cls["recall"] == cls["f1"] == 0.0 for cls in metrics["per_class"].values())


def test_label_indexes_outside_the_label_list_are_refused():
    with pytest.raises(ValueError, match="label index 2"):
        score([(1.0, 1.0)], [0.9], [2], [(1.0, 1.0)], [0])


def in_cells(counts: list[list[int]], cell: float = 10.0) -> np.ndarray:
    """Points (metres) in a grid of cells: counts[row][col] points in each cell, spread inside it."""
    xy = [
        ((col + 0.2 + 0.1 * k) * cell, (row + 0.3 + 0.1 * k) * cell)
        for row, line in enumerate(counts)
        for col, count in enumerate(line)
        for k in range(count)
    ]
    return points(*xy)


def test_count_errors_per_cell_of_a_known_layout():
    # 25 m x 25 m in 10 m cells: 2 x 2 whole cells of 0.01 ha (the partial strip beyond 20 m is left out)
    true = in_cells([[2, 0], [1, 3]])
    pred = np.concatenate([in_cells([[1, 0], [1, 5]]), points((22.0, 5.0), (5.0, 24.0))])  # two in the strip
    counts = count_errors(pred, true, 25.0, 25.0, 10.0)
    # predicted - true per cell: -1, 0, 0, +2 points = -100, 0, 0, +200 per ha
    assert counts["cells"] == 4 and counts["cell_area_ha"] == pytest.approx(0.01)
    assert counts["mae_per_ha"] == pytest.approx(75.0)  # (100 + 0 + 0 + 200) / 4
    assert counts["bias_per_ha"] == pytest.approx(25.0)  # (-100 + 200) / 4
    assert counts["true_per_ha"] == pytest.approx(150.0)  # 6 points / 4 cells / 0.01 ha
    assert counts["relative_mae"] == pytest.approx(0.5)
    assert counts["total_error"] == pytest.approx(1 / 6)  # 7 predicted in the cells, 6 true
    kept = count_errors(pred, true, 25.0, 25.0, 10.0, valid=np.array([[True, False], [False, True]]))
    assert kept["cells"] == 2
    assert (kept["mae_per_ha"], kept["bias_per_ha"]) == (pytest.approx(150.0), pytest.approx(50.0))
    assert kept["total_error"] == pytest.approx(1 / 5)  # 6 predicted, 5 true in the two cells


def test_a_raster_smaller_than_a_cell_is_one_cell():
    counts = count_errors(points((1.0, 1.0)), points((1.0, 1.0), (4.0, 7.0)), 5.0, 8.0, 10.0)
    assert counts["cells"] == 1 and counts["cell_area_ha"] == pytest.approx(0.004)
    assert counts["mae_per_ha"] == pytest.approx(250.0) and counts["bias_per_ha"] == pytest.approx(-250.0)
    assert counts["total_error"] == pytest.approx(-0.5)


def test_count_errors_without_truth_has_no_relative_error():
    counts = count_errors(points((1.0, 1.0)), points(), 20.0, 20.0, 10.0)
    assert (counts["relative_mae"], counts["total_error"], counts["true_per_ha"]) == (None, None, 0.0)
    assert counts["mae_per_ha"] == pytest.approx(25.0)  # one point in one of four cells of 0.01 ha
    with pytest.raises(ValueError, match="2 x 2 cells"):
        count_errors(points(), points(), 20.0, 20.0, 10.0, valid=np.ones((1, 2), dtype=bool))


def write_points(path, rows: list[tuple[str, float, float, float]]) -> None:
    """A merged layer: (label, score, px_x, px_y) rows as points in the raster's CRS."""
    px = np.array([(x, y) for _, _, x, y in rows], dtype=np.float64).reshape(-1, 2)
    frame = gpd.GeoDataFrame(
        {
            "label": [label for label, *_ in rows],
            "score": np.array([s for _, s, *_ in rows], dtype=np.float64),
            "px_x": px[:, 0],
            "px_y": px[:, 1],
            "tile_id": np.zeros(len(rows), dtype=np.int64),
        },
        geometry=gpd.points_from_xy(X0 + PIXEL * px[:, 0], Y0 - PIXEL * px[:, 1]),
        crs=UTM17N,
    )
    frame.to_parquet(path)


# four trees and a snag, one of each 10 m cell's (pixels (column, row) of 0.1 m)
TRUTH = Truth(points((20, 20), (150, 30), (40, 160), (170, 170), (60, 60)), np.array([0, 0, 0, 0, 1], dtype=np.int64))
PREDICTED = [
    ("tree", 0.9, 22.0, 20.0),  # 0.2 m from its truth
    ("tree", 0.8, 150.0, 32.0),  # 0.2 m
    ("tree", 0.7, 40.0, 162.0),  # 0.2 m
    ("tree", 0.6, 120.0, 80.0),  # nothing near: a false positive, in the top right cell
    ("snag", 0.95, 60.0, 60.0),  # on its truth
    ("tree", 0.1, 170.0, 170.0),  # on its truth, below the threshold
]


def test_evaluate_points_writes_the_json_and_the_quicklook(tmp_path):
    raster = str(write_raster(tmp_path / "scene.tif", 200, 200))
    layer, out, png = tmp_path / "points.parquet", tmp_path / "scene.json", tmp_path / "scene.png"
    write_points(layer, PREDICTED)
    metrics = evaluate_points(layer, raster, TRUTH, LABELS, 0.5, 0.5, 10.0, out, png)
    assert json.loads(out.read_text()) == metrics
    assert (metrics["matched"], metrics["predicted"], metrics["true"]) == (4, 5, 5)
    assert metrics["precision"] == metrics["recall"] == pytest.approx(0.8)
    assert metrics["mean_distance_m"] == pytest.approx(0.15)  # (3 x 0.2 + 0) / 4 metres
    assert metrics["per_class"]["snag"] == {
        "precision": 1.0,
        "recall": 1.0,
        "f1": 1.0,
        "matched": 1,
        "predicted": 1,
        "true": 1,
    }
    # falling threshold: recall 0.2, 0.4, 0.6, 0.8 at precision 1 (0.95 .. 0.7), then 1.0 at 5/6 (0.1)
    assert metrics["by_score"]["ap"] == pytest.approx(0.8 + 0.2 * 5 / 6)
    assert metrics["by_score"]["best_f1"] == pytest.approx(2 * (5 / 6) / (5 / 6 + 1))
    assert metrics["by_score"]["best_threshold"] == 0.1  # the highest of 0.05 and 0.1
    # per 10 m cell predicted - true: 0, +1, 0, -1 (the low-scoring tree is not counted)
    counts = metrics["counts"]
    assert (counts["cells"], counts["mae_per_ha"], counts["bias_per_ha"]) == (4, pytest.approx(50.0), 0.0)
    assert counts["total_error"] == 0.0
    assert metrics["labels"] == LABELS and metrics["scene_raster"] == raster
    assert (metrics["point_distance_m"], metrics["score_threshold"]) == (0.5, 0.5)
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    with Image.open(png) as image:
        image.verify()
    assert summarize(metrics) == ("precision=0.800 recall=0.800 f1=0.800 ap=0.967; count error +0.0% (MAE 50.0 /ha)")


def test_evaluate_points_refuses_a_label_not_in_the_list(tmp_path):
    raster = str(write_raster(tmp_path / "scene.tif", 200, 200))
    write_points(tmp_path / "points.parquet", [("bird", 0.9, 10.0, 10.0)])
    with pytest.raises(InputError, match="bird"):
        evaluate_points(
            tmp_path / "points.parquet", raster, TRUTH, LABELS, 0.5, 0.5, 10.0, tmp_path / "a.json", tmp_path / "a.png"
        )


def test_summarize_says_the_scores_and_the_count_error_in_one_line():
    metrics = {
        "precision": 0.9123,
        "recall": 0.9341,
        "f1": 0.9231,
        "by_score": {"ap": 0.9012},
        "counts": {"total_error": -0.021, "mae_per_ha": 12.34},
    }
    assert summarize(metrics) == "precision=0.912 recall=0.934 f1=0.923 ap=0.901; count error -2.1% (MAE 12.3 /ha)"
    metrics["counts"] = {"total_error": None, "mae_per_ha": 3.0}
    assert summarize(metrics).endswith("count error n/a (no true points) (MAE 3.0 /ha)")


def test_scored_points_and_the_quicklook_without_truth(tmp_path):
    layer, png = tmp_path / "points.parquet", tmp_path / "found.png"
    write_points(layer, PREDICTED)
    found = scored_points(layer, 0.7)
    np.testing.assert_array_equal(found, [(22.0, 20.0), (150.0, 32.0), (40.0, 162.0), (60.0, 60.0)])
    assert scored_points(layer, 2.0).shape == (0, 2)
    single_band = write_raster(tmp_path / "grey.tif", 120, 80, count=1)
    render_points_quicklook(single_band, found, None, png, title="found")
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    with Image.open(png) as image:
        assert image.size[0] >= 800  # a small scene's picture is enlarged to 800 pixels
