"""Merging rank rasters into classes.tif / probabilities.tif (valid COGs on the scene's grid, masked pixels no
data, a pixel claimed twice an error, memory of a block) and polygons of the class map (regions cut by strip
boundaries come out whole)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import rasterio
from affine import Affine
from rasterio.windows import Window
from rio_cogeo.cogeo import cog_validate

from conftest import UTM17N, report, write_raster, write_rgba
from rasterscale.imagery import ImageSpec, read_masked, resolve_spec
from rasterscale.segmentation.blend import NODATA_CLASS
from rasterscale.segmentation.merge import merge_class_rasters
from rasterscale.tiling import build_manifest, tiles_from_frame
from segmentation_tiles import class_map, predict_ranks, scene_with_hole

PATCH, OVERLAP = 256, 64
LABELS = ["background", "disc", "rectangle"]


def alpha_scene(path, width, height):
    data = np.random.default_rng(2).integers(1, 255, size=(4, height, width), dtype=np.uint8)
    data[3] = 255
    data[3, height // 2 :, width // 2 :] = 0  # no data in the bottom-right quarter
    data[3, 100:140, 50:90] = 0  # and a small hole inside a tile
    return write_rgba(path, data)


@pytest.mark.parametrize("mask", ["nodata", "alpha"])
def test_merge_writes_cogs_on_the_scene_grid_with_masked_pixels_as_nodata(tmp_path, mask):
    width, height = 1200, 900
    if mask == "nodata":
        scene = scene_with_hole(tmp_path / "scene.tif", width, height, hole_cols=(500, 800))
    else:
        scene = alpha_scene(tmp_path / "scene.tif", width, height)
    spec = resolve_spec(scene)
    assert spec.mask == mask
    tiles = tiles_from_frame(build_manifest(scene, PATCH, OVERLAP, skip_nodata=True, spec=spec))
    truth = class_map(width, height, seed=5)
    with rasterio.open(scene) as src:
        transform, crs = src.transform, src.crs
        valid = read_masked(src, spec)[1]
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    rank_rasters = predict_ranks(tiles, truth, OVERLAP, ranks, 2, transform, crs, probabilities=True)
    out = tmp_path / "out"
    classes_path, probs_path = out / "classes.tif", out / "probabilities.tif"
    summary = merge_class_rasters(rank_rasters, scene, spec, classes_path, probs_path, LABELS, block=256)
    assert sorted(p.name for p in out.iterdir()) == ["classes.tif", "probabilities.tif"]  # no scratch left
    for path in (classes_path, probs_path):
        is_valid, errors, _ = cog_validate(str(path))
        assert is_valid and not errors
    with rasterio.open(classes_path) as dst:
        assert (dst.crs, dst.transform, dst.width, dst.height) == (crs, transform, width, height)
        assert dst.count == 1 and dst.dtypes[0] == "uint8" and dst.nodata == NODATA_CLASS
        overviews = dst.overviews(1)
        assert overviews and dst.tags()["OVERVIEW_RESAMPLING"] == "MODE"
        assert json.loads(dst.tags()["labels"]) == LABELS
        classes = dst.read(1)
        overview = dst.read(1, out_shape=(height // overviews[0], width // overviews[0]))
    assert np.array_equal(classes == NODATA_CLASS, ~valid)
    assert set(np.unique(overview)) <= set(np.unique(classes))  # mode: classes, never their average
    counts = np.bincount(classes.ravel(), minlength=256)
    assert summary == {"pixels": dict(zip(LABELS, counts[:3].tolist(), strict=True)), "nodata_pixels": counts[255]}
    with rasterio.open(probs_path) as dst:
        assert (dst.crs, dst.transform, dst.count) == (crs, transform, 3)
        assert dst.tags()["OVERVIEW_RESAMPLING"] == "AVERAGE" and dst.overviews(1)
        assert dst.scales == pytest.approx((1 / 255,) * 3)
        assert np.array_equal(dst.dataset_mask() > 0, classes != NODATA_CLASS)
        probs = dst.read()
    agreement = float(np.mean(np.argmax(probs, axis=0)[valid] == classes[valid]))
    assert agreement > 0.99  # probabilities rounded to 1/255 may tie where the blend was close
    report(
        f"merge ({mask} mask): COGs valid, {width}x{height}, overviews {overviews}, pixels {summary['pixels']}, "
        f"no data {summary['nodata_pixels']}; argmax of stored probabilities = class at {agreement:.4%} of pixels"
    )


def write_rank(path, window: Window, classes: np.ndarray, transform: Affine) -> None:
    with rasterio.open(
        path,
        "w",
        driver="GTiff",
        width=int(window.width),
        height=int(window.height),
        count=1,
        dtype="uint8",
        crs=UTM17N,
        transform=rasterio.windows.transform(window, transform),
        nodata=NODATA_CLASS,
    ) as dst:
        dst.write(classes, 1)


def test_a_pixel_claimed_by_two_rank_rasters_fails_naming_both(tmp_path):
    scene = write_raster(tmp_path / "scene.tif", 300, 200)
    with rasterio.open(scene) as src:
        transform = src.transform
    first, second = tmp_path / "rank-0.tif", tmp_path / "rank-1.tif"
    top = np.full((120, 300), 1, dtype=np.uint8)
    bottom = np.full((100, 300), 2, dtype=np.uint8)
    bottom[:20, :150] = NODATA_CLASS  # rows 100-119 claimed by rank 0, except cols 150.. also by rank 1
    write_rank(first, Window(0, 0, 300, 120), top, transform)
    write_rank(second, Window(0, 100, 300, 100), bottom, transform)
    with pytest.raises(ValueError, match=r"pixel \(row 100, col 150\) claimed by two rank rasters") as error:
        merge_class_rasters([first, second], scene, ImageSpec(), tmp_path / "classes.tif", None, LABELS, block=64)
    assert str(first) in str(error.value) and str(second) in str(error.value)
    assert not (tmp_path / "classes.tif").exists()


def test_a_rank_raster_off_the_scene_grid_fails_naming_it(tmp_path):
    scene = write_raster(tmp_path / "scene.tif", 300, 200)
    with rasterio.open(scene) as src:
        shifted = src.transform * Affine.translation(0.5, 0)
    rank = tmp_path / "rank-0.tif"
    write_rank(rank, Window(0, 0, 100, 100), np.ones((100, 100), dtype=np.uint8), shifted)
    with pytest.raises(ValueError, match=f"{rank}: rank raster is not on the scene's pixel grid"):
        merge_class_rasters([rank], scene, ImageSpec(), tmp_path / "classes.tif", None, LABELS)
