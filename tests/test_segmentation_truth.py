"""Segmentation ground truth (rasterscale.tasks.segmentation.groundtruth) and the synthetic scene's crown polygons."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import shapely
import torch
from affine import Affine
from rasterio.windows import Window

from conftest import REPO, UTM17N, damage_block, write_raster, write_rgba
from rasterscale.datasets.sampling import Flips
from rasterscale.errors import InputError
from rasterscale.grid.tile import Tile
from rasterscale.raster.geo import pixel_boxes_to_polygons
from rasterscale.raster.imagery import resolve_spec
from rasterscale.tasks.segmentation.dataset import SegmentationTileDataset
from rasterscale.tasks.segmentation.groundtruth import (
    NODATA_CLASS,
    PolygonTruth,
    RasterTruth,
    check_segmentation_truth,
    read_segmentation_truth,
)
from rasterscale.tools.synth import synthesize_scene

TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
WIDTH, HEIGHT = 200, 100
LABELS = ("background", "tree", "building")
# Two pixel boxes (col0, row0, col1, row1): a tree of 40 x 40 px and a building of 30 x 20 px.
TREE_BOX, BUILDING_BOX = (20, 10, 60, 50), (120, 60, 150, 80)


def _polygons(path: Path, classes: list, crs: str = "EPSG:4326", column: str | None = "cls") -> Path:
    """The two boxes as polygons in UTM 17N, written in ``crs`` with their classes in ``column``."""
    geoms = pixel_boxes_to_polygons(np.array([TREE_BOX, BUILDING_BOX], dtype=np.float64), TRANSFORM)
    frame = gpd.GeoDataFrame(geometry=gpd.GeoSeries(geoms, crs=UTM17N)).to_crs(crs)
    if column:
        frame[column] = classes
    frame.to_file(path, layer="truth", driver="GPKG")
    return path


def _expected() -> np.ndarray:
    classes = np.zeros((HEIGHT, WIDTH), dtype=np.uint8)
    for value, (c0, r0, c1, r1) in ((1, TREE_BOX), (2, BUILDING_BOX)):
        classes[r0:r1, c0:c1] = value
    return classes


@pytest.fixture
def scene(tmp_path: Path) -> Path:
    return write_raster(tmp_path / "scene.tif", WIDTH, HEIGHT, transform=TRANSFORM)


def test_polygons_in_another_crs_are_reprojected_with_class_names(scene: Path, tmp_path: Path) -> None:
    path = _polygons(tmp_path / "truth.gpkg", ["tree", "building"])  # EPSG:4326, the raster is EPSG:32617
    truth = read_segmentation_truth(path, scene, LABELS, "cls")
    assert isinstance(truth, PolygonTruth)
    whole = truth.tile_classes(Window(0, 0, WIDTH, HEIGHT))
    assert whole.dtype == np.uint8
    np.testing.assert_array_equal(whole, _expected())  # 1600 tree and 600 building pixels, exactly
    assert np.bincount(whole.ravel()).tolist() == [WIDTH * HEIGHT - 2200, 1600, 600]
    window = Window(30, 20, 100, 70)
    np.testing.assert_array_equal(truth.tile_classes(window), _expected()[20:90, 30:130])
    assert not truth.tile_classes(Window(70, 0, 40, 40)).any()  # between the polygons: background only
    copy = pickle.loads(pickle.dumps(truth))
    np.testing.assert_array_equal(copy.tile_classes(window), truth.tile_classes(window))


def test_integer_class_ids_and_default_class(scene: Path, tmp_path: Path) -> None:
    ids = _polygons(tmp_path / "ids.gpkg", [2, 1])
    expected = _expected()
    swapped = np.choose(expected, [0, 2, 1]).astype(np.uint8)
    np.testing.assert_array_equal(
        read_segmentation_truth(ids, scene, LABELS, "cls").tile_classes(Window(0, 0, 200, 100)), swapped
    )
    plain = _polygons(tmp_path / "plain.gpkg", [], column=None)
    classes = read_segmentation_truth(plain, scene, LABELS).tile_classes(Window(0, 0, WIDTH, HEIGHT))
    np.testing.assert_array_equal(classes, (expected > 0).astype(np.uint8))  # every polygon: tree (class 1)


def test_class_raster(scene: Path, tmp_path: Path) -> None:
    classes = _expected()
    classes[:5, :5] = NODATA_CLASS
    path = write_raster(tmp_path / "classes.tif", WIDTH, HEIGHT, count=1, transform=TRANSFORM, data=classes[None])
    truth = read_segmentation_truth(path, scene, LABELS)
    assert isinstance(truth, RasterTruth)
    np.testing.assert_array_equal(truth.tile_classes(Window(0, 0, 50, 40)), classes[:40, :50])
    copy = pickle.loads(pickle.dumps(truth))
    np.testing.assert_array_equal(copy.tile_classes(Window(100, 50, 100, 50)), classes[50:, 100:])


def test_a_class_raster_block_that_will_not_decode_fails_in_one_line_naming_the_file(tmp_path: Path) -> None:
    import rasterio

    scene = write_raster(tmp_path / "scene.tif", 256, 256, transform=TRANSFORM)
    classes = np.random.default_rng(0).integers(0, len(LABELS), size=(1, 256, 256), dtype=np.uint8)
    path = tmp_path / "classes.tif"
    profile = dict(driver="GTiff", width=256, height=256, count=1, dtype="uint8", crs=UTM17N, transform=TRANSFORM)
    with rasterio.open(path, "w", tiled=True, blockxsize=128, blockysize=128, compress="deflate", **profile) as dst:
        dst.write(classes)
    damage_block(path, 1, 0)  # cols 128-256, rows 0-128
    truth = read_segmentation_truth(path, scene, LABELS)
    np.testing.assert_array_equal(truth.tile_classes(Window(0, 128, 256, 128)), classes[0, 128:])  # sound blocks
    for read in (lambda: truth.tile_classes(Window(100, 0, 128, 128)), lambda: truth.classes_at((64, 64))):
        with pytest.raises(InputError) as err:
            read()
        assert "will not decode" in _one_line(err, path) and "the file is damaged" in str(err.value)


def _one_line(err: pytest.ExceptionInfo, path: Path) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(path)), text
    return text


def test_bad_ground_truth_fails_with_one_line_naming_the_file(scene: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.gpkg"
    with pytest.raises(InputError) as err:
        check_segmentation_truth(missing, scene, LABELS)
    assert "not found" in _one_line(err, missing)

    unknown = _polygons(tmp_path / "unknown.gpkg", ["tree", "shrub"])
    for call in (check_segmentation_truth, read_segmentation_truth):
        with pytest.raises(InputError) as err:
            call(unknown, scene, LABELS, "cls")
        assert "shrub" in _one_line(err, unknown) and "background, tree, building" in str(err.value)

    empty = tmp_path / "empty.gpkg"
    gpd.GeoDataFrame({"cls": []}, geometry=gpd.GeoSeries([], crs=UTM17N)).to_file(empty, driver="GPKG")
    with pytest.raises(InputError) as err:
        read_segmentation_truth(empty, scene, LABELS, "cls")
    assert "no polygons" in _one_line(err, empty)

    shifted = TRANSFORM @ Affine.translation(3, 0)
    misaligned = write_raster(tmp_path / "shifted.tif", WIDTH, HEIGHT, count=1, transform=shifted)
    with pytest.raises(InputError) as err:
        check_segmentation_truth(misaligned, scene, LABELS)
    assert "not on the grid" in _one_line(err, misaligned) and str(scene) in str(err.value)

    no_column = _polygons(tmp_path / "nocolumn.gpkg", ["tree", "building"])
    with pytest.raises(InputError) as err:
        check_segmentation_truth(no_column, scene, LABELS, "class_name")
    assert "no column 'class_name'" in _one_line(err, no_column)


def test_tile_dataset_masks_invalid_pixels_and_flips_image_and_mask_together(tmp_path: Path) -> None:
    expected = _expected()
    pixels = np.full((4, HEIGHT, WIDTH), 60, dtype=np.uint8)
    pixels[0][expected > 0] = 220  # red where there is a class
    pixels[3] = 255
    pixels[3, :, 180:] = 0  # alpha 0: no data in the last 20 columns
    raster = write_rgba(tmp_path / "rgba.tif", pixels, transform=TRANSFORM)
    truth = read_segmentation_truth(_polygons(tmp_path / "truth.gpkg", ["tree", "building"]), raster, LABELS, "cls")
    tiles = [Tile(0, 0, 0, 100, 100), Tile(1, 100, 0, 100, 100)]
    data = SegmentationTileDataset(raster, tiles, resolve_spec(raster), truth)
    image, mask = data[1]
    assert image.shape == (3, 100, 100) and image.dtype == torch.float32 and mask.dtype == torch.int64
    assert (mask[:, 80:] == NODATA_CLASS).all()  # the masked columns 180..199 of the raster
    np.testing.assert_array_equal(mask[:, :80].numpy(), expected[:, 100:180])
    plain_image, plain_mask = data[0]
    for horizontal, vertical in [(True, False), (False, True), (True, True)]:
        image, mask = data.sample(0, Flips(horizontal, vertical))
        np.testing.assert_array_equal((mask > 0).numpy(), (image[0] > 0.5).numpy())  # flipped together
        dims = [d for d, flipped in ((-1, horizontal), (-2, vertical)) if flipped]
        assert torch.equal(mask, plain_mask.flip(dims)) and torch.equal(image, plain_image.flip(dims))


# --- synthetic crown polygons ---------------------------------------------------------------------------------


def test_synth_crown_polygons_leave_raster_and_boxes_unchanged(tmp_path: Path) -> None:
    size = {"width": 512, "height": 384, "seed": 11, "block_size": 128}
    plain, with_crowns = tmp_path / "plain", tmp_path / "crowns"
    n = synthesize_scene(plain / "scene.tif", plain / "boxes.gpkg", **size)
    crowns_path = with_crowns / "polygons.gpkg"
    assert synthesize_scene(with_crowns / "scene.tif", with_crowns / "boxes.gpkg", crowns_path=crowns_path, **size) == n
    assert (plain / "scene.tif").read_bytes() == (with_crowns / "scene.tif").read_bytes()
    boxes = gpd.read_file(plain / "boxes.gpkg", layer="crowns")
    same = gpd.read_file(with_crowns / "boxes.gpkg", layer="crowns")
    assert boxes.geometry.to_wkb().tolist() == same.geometry.to_wkb().tolist()
    assert boxes["label"].tolist() == same["label"].tolist()

    polygons = gpd.read_file(crowns_path, layer="crowns")
    assert polygons.crs == boxes.crs and set(polygons["label"]) == {"tree"}
    assert len(polygons) >= n  # every labelled crown, and crowns cut by the edge that have no box
    union = polygons.union_all()
    assert union.area == pytest.approx(polygons.area.sum(), rel=1e-6)  # visible outlines do not overlap
    box_area = boxes.area.sum()
    assert 0.55 * box_area < union.area < 0.9 * box_area  # a rounded crown covers ~pi/4 of its box
    pixel = 0.1
    bounds = shapely.box(404000.0, 3285000.0 - 384 * pixel, 404000.0 + 512 * pixel, 3285000.0)
    assert union.within(bounds.buffer(1e-6))
    tree = shapely.STRtree(boxes.geometry.buffer(pixel, join_style="mitre").to_numpy())
    in_a_box = np.zeros(len(polygons), dtype=bool)
    index, _ = tree.query(polygons.geometry.to_numpy(), predicate="within")
    in_a_box[index] = True
    at_edge = ~polygons.geometry.within(bounds.buffer(-pixel)).to_numpy()
    assert (in_a_box | at_edge).all()  # each polygon lies in a box (to a pixel), or it is cut by the edge
    assert in_a_box.sum() >= n - 2


def test_the_demo_entry_writes_crown_polygons_with_crowns(tmp_path: Path) -> None:
    from rasterscale.jobs.files import SynthesisJob
    from rasterscale.settings import job_settings

    entry = REPO / "scripts" / "demo.py"
    scene = {"width": 128, "height": 96, "seed": 3, "nir": False}
    demo = {"directory": str(tmp_path), "crs": "EPSG:32617", "pixel_size": 0.1, "scenes": {"s": scene}}
    SynthesisJob("s", job_settings({"demo": demo})).write(tmp_path / "job.json")
    raster, boxes, crowns = tmp_path / "s.tif", tmp_path / "s.gpkg", tmp_path / "s.crowns.gpkg"
    command = [sys.executable, str(entry), "--job", str(tmp_path / "job.json"), "--raster", str(raster)]
    command += ["--boxes", str(boxes), "--crowns", str(crowns)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert f"outlines -> {crowns}" in done.stdout
    polygons = gpd.read_file(crowns, layer="crowns")
    assert len(polygons) > 0 and polygons.crs == UTM17N
    truth = read_segmentation_truth(crowns, raster, ("background", "tree"))
    assert 0.1 < truth.tile_classes(Window(0, 0, 128, 96)).mean() < 0.9  # crowns and ground both
