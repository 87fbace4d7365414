import numpy as np
import pytest

from rasterscale.tasks.detection.metrics import average_precision, evaluate_detections, match_detections


def test_perfect_predictions_score_one():
    gt = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], dtype=float)
    m = evaluate_detections(gt, np.array([0.9, 0.8]), np.zeros(2), gt, np.zeros(2))
    assert (m["precision"], m["recall"], m["f1"], m["map50"]) == pytest.approx((1, 1, 1, 1))


def test_one_to_one_matching_by_score():
    gt = np.array([[0, 0, 10, 10]], dtype=float)
    preds = np.array([[0, 0, 10, 10], [0, 0, 10, 9]], dtype=float)
    matched = match_detections(preds, np.array([0.5, 0.9]), gt, 0.4)
    assert matched.tolist() == [False, True]  # the higher score takes the only truth


def test_iou_threshold_and_score_threshold():
    gt = np.array([[0, 0, 10, 10], [100, 100, 110, 110]], dtype=float)
    preds = np.array([[0, 0, 10, 6], [100, 100, 110, 110], [300, 300, 310, 310]], dtype=float)
    scores = np.array([0.9, 0.2, 0.8])
    m = evaluate_detections(preds, scores, np.zeros(3), gt, np.zeros(2), iou_threshold=0.4, score_threshold=0.5)
    # IoU of the first is 0.6 (match); the second is below the score threshold; the third is a false positive
    assert m["true_positives"] == 1 and m["predictions"] == 2
    assert m["precision"] == pytest.approx(0.5) and m["recall"] == pytest.approx(0.5)


def test_labels_match_class_by_class():
    gt = np.array([[0, 0, 10, 10]], dtype=float)
    m = evaluate_detections(gt, np.array([0.9]), np.array([1]), gt, np.array([0]))
    assert m["true_positives"] == 0


def test_average_precision_interpolation():
    # two truths; ranked predictions TP, FP, TP -> precision envelope 1 up to recall .5, 2/3 up to recall 1
    ap = average_precision(np.array([0.9, 0.8, 0.7]), np.array([True, False, True]), 2)
    expected = (51 * 1.0 + 50 * (2 / 3)) / 101
    assert ap == pytest.approx(expected)
    assert average_precision(np.array([0.5]), np.array([False]), 3) == 0.0
