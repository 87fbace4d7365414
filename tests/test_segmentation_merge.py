"""Merging rank rasters into classes.tif / probabilities.tif (valid COGs on the scene's grid, masked pixels no
data, a pixel claimed twice an error, memory of a block) and polygons of the class map (regions cut by strip
boundaries come out whole)."""

from __future__ import annotations

import json
import tracemalloc

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import rasterio.features
import shapely
from affine import Affine
from rasterio.windows import Window
from rio_cogeo.cogeo import cog_validate

from conftest import UTM17N, report, write_raster, write_rgba
from rasterscale.grid.manifest import build_manifest, tiles_from_frame
from rasterscale.raster.imagery import ImageSpec, read_masked, resolve_spec
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.merge import merge_class_rasters
from rasterscale.tasks.segmentation.vectorize import vectorize_classes
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


def test_a_merge_on_two_threads_writes_the_same_layers_and_the_polygons_of_its_class_map(tmp_path):
    """The layers made side by side on two threads, the polygons read from the assembled classes meanwhile: the
    files a merge on one thread writes, byte for byte, and the polygons of its classes.tif."""
    width, height = 1200, 900
    scene = scene_with_hole(tmp_path / "scene.tif", width, height, hole_cols=(500, 800))
    spec = resolve_spec(scene)
    tiles = tiles_from_frame(build_manifest(scene, PATCH, OVERLAP, skip_nodata=True, spec=spec))
    with rasterio.open(scene) as src:
        transform, crs = src.transform, src.crs
    (tmp_path / "ranks").mkdir()
    truth = class_map(width, height, seed=5)
    rank_rasters = predict_ranks(tiles, truth, OVERLAP, tmp_path / "ranks", 2, transform, crs, probabilities=True)
    one, two = tmp_path / "one", tmp_path / "two"
    layers = ("classes.tif", "probabilities.tif")
    alone = merge_class_rasters(rank_rasters, scene, spec, *(one / name for name in layers), LABELS, block=256)
    polygons = vectorize_classes(one / "classes.tif", one / "classes.gpkg", LABELS)
    summary = merge_class_rasters(
        rank_rasters,
        scene,
        spec,
        *(two / name for name in layers),
        LABELS,
        256,
        gpkg_path=two / "classes.gpkg",
        threads=2,
    )
    assert summary == {**alone, "polygons": polygons} and polygons > 0
    assert sorted(p.name for p in two.iterdir()) == ["classes.gpkg", *layers]  # no scratch left
    for name in layers:
        assert (two / name).read_bytes() == (one / name).read_bytes()
    expected, found = (gpd.read_file(folder / "classes.gpkg", layer="classes") for folder in (one, two))
    assert expected.drop(columns="geometry").equals(found.drop(columns="geometry"))
    assert (expected.geometry.to_wkb() == found.geometry.to_wkb()).all()


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


def shapes_raster(path, width: int = 500, height: int = 400) -> tuple[np.ndarray, Affine]:
    """A class map: a disc (class 1) and a ring (class 2, one hole) each crossing several 32-row strips, a few
    squares of class 1, a no-data corner, on background."""
    rows, cols = np.mgrid[0:height, 0:width] + 0.5
    classes = np.zeros((height, width), dtype=np.uint8)
    classes[(cols - 150) ** 2 + (rows - 200) ** 2 < 90**2] = 1
    ring = (cols - 370) ** 2 + (rows - 220) ** 2
    classes[(ring < 100**2) & (ring >= 60**2)] = 2
    for k in range(5):
        classes[10 + 70 * k : 30 + 70 * k, 5:25] = 1
    classes[:20, 450:] = NODATA_CLASS
    transform = Affine(0.25, 0, 500000.0, 0, -0.25, 4000000.0)
    write_raster(path, width, height, count=1, data=classes[None], nodata=NODATA_CLASS, transform=transform)
    return classes, transform


def test_vectorize_joins_regions_cut_by_block_boundaries(tmp_path):
    classes, transform = shapes_raster(tmp_path / "classes.tif")
    pixel_area = abs(transform.a * transform.e)
    strips, whole = tmp_path / "strips.gpkg", tmp_path / "whole.gpkg"
    count = vectorize_classes(tmp_path / "classes.tif", strips, LABELS, block=32)
    assert vectorize_classes(tmp_path / "classes.tif", whole, LABELS, block=400) == count == 7
    frame = gpd.read_file(strips, layer="classes")
    assert frame.crs == UTM17N and list(frame.columns) == ["class_id", "label", "area", "geometry"]
    assert set(frame["class_id"]) == {1, 2}  # background and no data skipped
    assert frame.geometry.is_valid.all() and (frame.geom_type == "Polygon").all()
    disc = frame[frame.area > 1000 * pixel_area].query("class_id == 1")
    ring = frame.query("class_id == 2")
    assert len(disc) == 1 and len(ring) == 1
    disc_pixels = int((classes[:, 40:300] == 1).sum())  # the disc alone (the squares lie in columns 5-24)
    assert disc.geometry.iloc[0].contains(shapely.Point(*(transform * (150, 200))))
    assert disc["area"].iloc[0] == pytest.approx(disc_pixels * pixel_area, rel=0.01)
    assert ring["area"].iloc[0] == pytest.approx(int((classes == 2).sum()) * pixel_area, rel=1e-9)
    assert len(ring.geometry.iloc[0].interiors) == 1
    assert frame["area"].sum() == pytest.approx(int(((classes == 1) | (classes == 2)).sum()) * pixel_area)
    by_strips = sorted(frame["area"].round(6))
    assert by_strips == sorted(gpd.read_file(whole, layer="classes")["area"].round(6))
    report(
        f"vectorize: 32 px blocks give {count} polygons, as one strip does; disc {disc['area'].iloc[0]:.2f} m² "
        f"({disc_pixels} px), ring with {len(ring.geometry.iloc[0].interiors)} hole"
    )


@pytest.mark.parametrize("budget", [{"max_open_vertices": 40}, {"max_region_vertices": 40}])
def test_vectorize_writes_regions_over_the_vertex_budget_in_parts(tmp_path, budget):
    shapes_raster(tmp_path / "classes.tif")
    whole, parts = tmp_path / "whole.gpkg", tmp_path / "parts.gpkg"
    vectorize_classes(tmp_path / "classes.tif", whole, LABELS, block=32)
    vectorize_classes(tmp_path / "classes.tif", parts, LABELS, block=32, **budget)
    before, after = gpd.read_file(whole, layer="classes"), gpd.read_file(parts, layer="classes")
    assert len(after) > len(before)  # the disc in several polygons, each ending at a block boundary
    assert after["area"].sum() == pytest.approx(before["area"].sum())
    assert shapely.union_all(after.geometry).area == pytest.approx(shapely.union_all(before.geometry).area)
    assert after.geometry.is_valid.all()


def test_vectorize_by_blocks_gives_the_regions_of_the_whole_map(tmp_path):
    """A blotchy 3-class map (regions crossing many blocks both ways, holes, diagonal contacts): 37 px blocks give
    exactly the polygons rasterio's shapes finds on the whole map at once."""
    rng = np.random.default_rng(11)
    coarse = rng.integers(0, 3, size=(30, 36), dtype=np.uint8)
    classes = np.kron(coarse, np.ones((9, 9), dtype=np.uint8))[:263, :301]
    noise = rng.random(classes.shape) < 0.02
    classes[noise] = rng.integers(0, 3, size=int(noise.sum()), dtype=np.uint8)
    path = tmp_path / "classes.tif"
    transform = Affine(0.5, 0, 500000.0, 0, -0.5, 4000000.0)
    write_raster(path, 301, 263, count=1, data=classes[None], nodata=NODATA_CLASS, transform=transform)
    count = vectorize_classes(path, tmp_path / "blocks.gpkg", LABELS, block=37)
    frame = gpd.read_file(tmp_path / "blocks.gpkg", layer="classes")
    whole = [
        (int(value), round(shapely.geometry.shape(geometry).area * 0.25, 6))
        for geometry, value in rasterio.features.shapes(classes, mask=classes > 0, connectivity=4)
    ]
    assert count == len(frame) == len(whole)
    assert sorted(zip(frame["class_id"], frame["area"].round(6), strict=True)) == sorted(whole)
    assert frame.geometry.is_valid.all() and (frame.geom_type == "Polygon").all()
    report(f"vectorize: 37 px blocks give the {count} polygons of the whole 301x263 map, areas equal")


def test_vectorize_an_all_background_map_writes_an_empty_layer(tmp_path):
    path = tmp_path / "classes.tif"
    write_raster(path, 64, 64, count=1, data=np.zeros((1, 64, 64), dtype=np.uint8), nodata=NODATA_CLASS)
    assert vectorize_classes(path, tmp_path / "classes.gpkg", LABELS, block=16) == 0
    frame = gpd.read_file(tmp_path / "classes.gpkg", layer="classes")
    assert len(frame) == 0 and frame.crs == UTM17N


def test_merge_of_an_8192_px_square_class_map_holds_blocks_not_the_raster(tmp_path):
    side, half = 8192, 4096
    scene = tmp_path / "scene.tif"
    transform = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
    profile = {"driver": "GTiff", "width": side, "height": side, "count": 3, "dtype": "uint8", "crs": UTM17N}
    with rasterio.open(scene, "w", transform=transform, tiled=True, sparse_ok=True, **profile):
        pass  # a sparse scene: no block written, every pixel valid
    rank_rasters = []
    for rank in range(2):
        path = tmp_path / f"rank-{rank}.tif"
        window = Window(0, rank * half, side, half)
        with rasterio.open(
            path,
            "w",
            driver="GTiff",
            width=side,
            height=half,
            count=1,
            dtype="uint8",
            crs=UTM17N,
            transform=rasterio.windows.transform(window, transform),
            nodata=NODATA_CLASS,
            blockysize=32,
            compress="deflate",
        ) as dst:
            for row in range(0, half, 512):
                rows, cols = np.mgrid[row : row + 512, 0:side]
                dst.write(((rows // 64 + cols // 64 + rank) % 3).astype(np.uint8), 1, window=Window(0, row, side, 512))
        rank_rasters.append(path)
    tracemalloc.start()
    summary = merge_class_rasters(rank_rasters, scene, ImageSpec(), tmp_path / "classes.tif", None, LABELS)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    raster_bytes = side * side
    assert sum(summary["pixels"].values()) == raster_bytes and summary["nodata_pixels"] == 0
    assert cog_validate(str(tmp_path / "classes.tif"))[0]
    report(
        f"merge memory, {side}x{side} class map ({raster_bytes / 2**20:.0f} MiB): tracemalloc peak "
        f"{peak / 2**20:.1f} MiB"
    )
    assert peak < raster_bytes / 4
