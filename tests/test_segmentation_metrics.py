"""Segmentation scores (rasterscale.tasks.segmentation.metrics) on hand-made maps with known answers."""

from __future__ import annotations

from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import shapely
from affine import Affine
from rasterio.windows import Window

from conftest import UTM17N, write_raster
from rasterscale.tasks.segmentation.groundtruth import read_segmentation_truth
from rasterscale.tasks.segmentation.metrics import (
    confusion_matrix,
    evaluate_class_map,
    iou_scores,
    render_segmentation_quicklook,
)

TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
LABELS = ("background", "tree", "building")


def test_confusion_matrix_counts_truth_by_prediction_and_skips_ignored_pixels() -> None:
    truth = np.array([[0, 0, 1, 1], [2, 2, 255, 1]], dtype=np.uint8)
    pred = np.array([[0, 1, 1, 1], [2, 0, 1, 255]], dtype=np.uint8)
    expected = [[1, 1, 0], [0, 2, 0], [1, 0, 1]]  # rows truth, columns prediction; two pixels ignored
    assert confusion_matrix(pred, truth, 3).tolist() == expected
    assert confusion_matrix(pred, truth, 3).dtype == np.int64
    with pytest.raises(ValueError, match=r"class ids must be 0\.\.1"):
        confusion_matrix(pred, truth, 2)


def test_iou_figures_with_known_answers() -> None:
    # truth 0 0 1 1, prediction 0 1 1 1: IoU(0) = 1/2, IoU(1) = 2/3, accuracy 3/4; class 2 in neither
    confusion = confusion_matrix(np.array([0, 1, 1, 1]), np.array([0, 0, 1, 1]), 3)
    scores = iou_scores(confusion, LABELS)
    assert scores["iou"] == {"background": pytest.approx(0.5), "tree": pytest.approx(2 / 3), "building": None}
    assert scores["miou"] == pytest.approx((0.5 + 2 / 3) / 2)  # the absent class is left out of the mean
    assert scores["pixel_accuracy"] == pytest.approx(0.75) and scores["pixels"] == 4
    # a class predicted but never true has IoU 0 and counts in the mean
    scores = iou_scores(confusion_matrix(np.array([2, 1]), np.array([1, 1]), 3), LABELS)
    assert scores["iou"] == {"background": None, "tree": pytest.approx(0.5), "building": 0.0}
    assert scores["miou"] == pytest.approx(0.25)
    perfect = iou_scores(confusion_matrix(np.arange(3), np.arange(3), 3), LABELS)
    assert perfect["miou"] == 1.0 and perfect["pixel_accuracy"] == 1.0
    empty = iou_scores(np.zeros((3, 3), dtype=np.int64), LABELS)
    assert empty["miou"] is None and empty["pixel_accuracy"] is None


@pytest.fixture
def maps(tmp_path: Path) -> tuple[Path, Path, object]:
    """A 300 x 200 px scene, truth polygons (a disc of trees, a building) and a noisy class map with nodata."""
    width, height = 300, 200
    scene = write_raster(tmp_path / "scene.tif", width, height, transform=TRANSFORM)
    centre = TRANSFORM @ (120, 90)
    disc = shapely.Point(centre).buffer(6.0)  # 60 px radius
    building = shapely.box(*(TRANSFORM @ (200, 180)), *(TRANSFORM @ (280, 20)))
    frame = gpd.GeoDataFrame({"cls": ["tree", "building"]}, geometry=[disc, building], crs=UTM17N)
    frame.to_file(tmp_path / "truth.gpkg", driver="GPKG")
    truth = read_segmentation_truth(tmp_path / "truth.gpkg", scene, LABELS, "cls")
    rng = np.random.default_rng(1)
    classes = truth.tile_classes(Window(0, 0, width, height)).copy()
    flip = rng.random(classes.shape) < 0.2
    classes[flip] = rng.integers(0, 3, size=int(flip.sum()))
    classes[:, :7] = 255  # not predicted
    classes_tif = tmp_path / "classes.tif"
    write_raster(classes_tif, width, height, count=1, transform=TRANSFORM, data=classes[None])
    return scene, classes_tif, truth


def test_streaming_evaluation_equals_the_whole_array_computation(maps: tuple[Path, Path, object]) -> None:
    _, classes_tif, truth = maps
    with rasterio.open(classes_tif) as src:
        classes = src.read(1)
    whole = confusion_matrix(classes, truth.tile_classes(Window(0, 0, 300, 200)), 3)
    for block in (64, 128, 1024):  # blocks that divide the raster, that do not, and one block
        scores = evaluate_class_map(classes_tif, truth, block=block)
        assert scores["confusion"] == whole.tolist()
        assert scores == {**iou_scores(whole, LABELS), "confusion": whole.tolist(), "labels": list(LABELS)}
    assert scores["pixels"] == 300 * 200 - 7 * 200  # the columns without prediction are left out
    assert 0.8 < scores["pixel_accuracy"] < 0.9  # 20% of pixels redrawn at random, a third of them right again


def test_misaligned_class_map_is_refused(maps: tuple[Path, Path, object], tmp_path: Path) -> None:
    _, _, truth = maps
    shifted = write_raster(tmp_path / "shifted.tif", 300, 200, count=1, transform=TRANSFORM @ Affine.translation(0, 5))
    with pytest.raises(ValueError, match="not on the grid"):
        evaluate_class_map(shifted, truth)


def test_quicklook_is_a_decimated_png(maps: tuple[Path, Path, object], tmp_path: Path) -> None:
    scene, classes_tif, truth = maps
    png = tmp_path / "out" / "quicklook.png"
    render_segmentation_quicklook(scene, classes_tif, truth, png, max_side=150, title="scene: mIoU 0.70")
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and max(image.size) <= 150
    assert not list(png.parent.glob(".*tmp*"))  # written atomically, no temporary left
