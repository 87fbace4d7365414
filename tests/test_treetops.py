"""Tree tops from a height raster: the local maxima of a window growing with height, found once whatever the
blocks, across a scene border in a VRT mosaic, one per plateau, never on no-data; and their scores against truth.

Heights are domes ``h * (1 - (d / r)^2)`` (d, r in pixels; max over domes, 0 ground) on 0.5 m pixels: with the
default rule (diameter ``3 + 0.1 h`` metres in [3, 10]) a pixel of height h looks ``R = round(3 + 0.1 h)`` pixels
around itself (``dy² + dx² <= R (R + 1)``), R = 10 at most."""

from __future__ import annotations

import logging
import math

import geopandas as gpd
import numpy as np
import pyogrio
import pytest
import rasterio
from affine import Affine
from shapely.geometry import LineString, MultiPoint, Point

from conftest import UTM17N, write_raster
from rasterscale.errors import InputError
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.tasks.regression import treetops
from rasterscale.tasks.regression.treetops import (
    LAYER,
    TreeTopRule,
    find_tree_tops,
    local_maxima,
    score_tree_tops,
    write_tree_tops,
)

PIXEL = 0.5
X0, Y0 = 404000.0, 3285000.0
TRANSFORM = Affine(PIXEL, 0, X0, 0, -PIXEL, Y0)
RULE = TreeTopRule(min_height=2.0)


def domes(shape: tuple[int, int], spec: list[tuple[int, int, float, float]]) -> np.ndarray:
    """A height field: the max over domes (row, col, height, radius in pixels) of ``h * (1 - (d/r)^2)``, 0 ground."""
    rows, cols = np.mgrid[: shape[0], : shape[1]]
    field = np.zeros(shape)
    for row, col, height, radius in spec:
        d2 = (rows - row) ** 2 + (cols - col) ** 2
        field = np.maximum(field, height * (1 - d2 / radius**2))
    return field.astype(np.float32)


def write_heights(path, data: np.ndarray, transform: Affine = TRANSFORM, nodata: float | None = None):
    return write_raster(
        path, data.shape[1], data.shape[0], count=1, transform=transform, nodata=nodata, data=data[None]
    )


def centre(row: int, col: int) -> tuple[float, float]:
    return X0 + PIXEL * (col + 0.5), Y0 - PIXEL * (row + 0.5)


def pixels(frame: gpd.GeoDataFrame) -> list[tuple[int, int]]:
    """The tops' (row, col) back from their pixel centres."""
    return [
        (round((Y0 - y) / PIXEL - 0.5), round((x - X0) / PIXEL - 0.5))
        for x, y in zip(frame.geometry.x, frame.geometry.y, strict=True)
    ]


def as_records(frame: gpd.GeoDataFrame) -> list[tuple[float, float, float]]:
    return list(zip(frame.geometry.x, frame.geometry.y, frame["height"], strict=True))


def found(data: np.ndarray, tmp_path, block: int = 4096, name: str = "h.tif", **raster) -> gpd.GeoDataFrame:
    return find_tree_tops(write_heights(tmp_path / name, data, **raster), RULE, block=block)


def scattered(
    seed: int, shape: tuple[int, int], count: int, away_from: list[tuple[int, int, float, float]]
) -> list[tuple[int, int, float, float]]:
    """Random domes (heights 1-40 m, radii 3-12 px) that neither cover nor hide those of ``away_from``: their
    slopes do not meet and each apex is beyond the other's largest window (10 px)."""
    rng = np.random.default_rng(seed)
    spec = [
        (
            int(rng.integers(0, shape[0])),
            int(rng.integers(0, shape[1])),
            float(rng.uniform(1, 40)),
            float(rng.uniform(3, 12)),
        )
        for _ in range(count)
    ]
    return [
        (row, col, h, r)
        for row, col, h, r in spec
        if all(math.hypot(row - row2, col - col2) > r + r2 + 10 for row2, col2, _, r2 in away_from)
    ]


def test_each_dome_s_apex_is_one_top_at_its_pixel_with_its_height_and_none_below_min_height(tmp_path):
    spec = [(20, 30, 5.0, 6), (25, 90, 12.0, 8), (70, 40, 20.0, 10), (80, 100, 31.5, 12), (110, 15, 1.5, 6)]
    frame = found(domes((128, 128), spec), tmp_path)

    tall = [(row, col, height) for row, col, height, _ in spec if height >= RULE.min_height]
    assert pixels(frame) == sorted((row, col) for row, col, _ in tall)
    assert frame["height"].tolist() == pytest.approx([h for _, _, h in sorted(tall)])
    assert [(p.x, p.y) for p in frame.geometry] == [centre(row, col) for row, col, _ in sorted(tall)]
    assert frame.crs == UTM17N and list(frame.columns) == ["height", "geometry"]
    assert (frame["height"] >= RULE.min_height).all()


def test_the_window_grows_with_height_a_tall_neighbour_suppresses_where_a_short_one_does_not(tmp_path):
    # 6 px (3 m) apart: a 28 m tree's window (R 6: 36 <= 42) holds the 30 m apex; a 4.5 m tree's (R 3: 36 > 12)
    # does not hold the 5 m apex. A 6 m dome 4 px from a 30 m apex (R 4: 16 <= 20) is in its window; two tall
    # trees 40 px apart are both tops.
    spec = [
        (20, 20, 30.0, 3),
        (20, 26, 28.0, 3),
        (60, 20, 5.0, 3),
        (60, 26, 4.5, 3),
        (100, 20, 30.0, 3),
        (100, 24, 6.0, 3),
        (100, 64, 29.0, 3),
    ]
    frame = found(domes((128, 96), spec), tmp_path)

    assert pixels(frame) == [(20, 20), (60, 20), (60, 26), (100, 20), (100, 64)]
    assert frame["height"].tolist() == pytest.approx([30.0, 5.0, 4.5, 30.0, 29.0])


@pytest.fixture(params=[None, 1, 7], ids=["one-chunk", "chunks-of-1", "chunks-of-7"])
def chunked(request, monkeypatch):
    """Survivors × offsets compared all at once, or a few at a time (those beaten or done drop out between)."""
    if request.param:
        monkeypatch.setattr(treetops, "CHUNK_ELEMENTS", request.param)


@pytest.mark.usefixtures("chunked")
def test_the_window_is_the_pixels_within_r_and_a_half_pixels_of_its_centre():
    heights = np.zeros((24, 24))
    heights[2, 2], heights[3, 3] = 5.0, 6.0  # diagonal neighbours on 1.5 m pixels (R 1: dy² + dx² <= 2)
    heights[10, 2], heights[12, 2] = 5.0, 6.0  # 2 px apart: beyond R 1
    rows, cols, _ = local_maxima(heights, None, 1.5, RULE)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(3, 3), (10, 2), (12, 2)]

    heights = np.zeros((12, 40))
    heights[2, 2], heights[8, 4] = 29.0, 30.0  # (6, 2): 40 <= 42, R 6 on 0.5 m pixels
    heights[2, 22], heights[8, 25] = 29.0, 30.0  # (6, 3): 45 > 42
    rows, cols, _ = local_maxima(heights, None, PIXEL, RULE)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(2, 22), (8, 4), (8, 25)]


@pytest.mark.usefixtures("chunked")
def test_local_maxima_are_the_pixels_no_pixel_of_their_own_window_exceeds():
    rng = np.random.default_rng(4)
    heights = rng.uniform(0, 40, size=(40, 48))
    heights[rng.random(heights.shape) < 0.05] = np.nan
    pixel = 0.25  # radii 6 (3 m) to 20 (10 m)
    rows, cols, values = local_maxima(heights, None, pixel, RULE)

    radius = RULE.radius_px(np.nan_to_num(heights), pixel)
    yy, xx = np.mgrid[: heights.shape[0], : heights.shape[1]]
    expected = [
        (row, col)
        for row, col in zip(*np.nonzero(heights >= RULE.min_height), strict=True)
        if not (
            (heights > heights[row, col])
            & ((yy - row) ** 2 + (xx - col) ** 2 <= radius[row, col] * (radius[row, col] + 1))
        ).any()
    ]
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == expected and len(expected) > 3
    assert values.tolist() == [heights[row, col] for row, col in expected]


def test_tops_are_the_same_points_whatever_the_blocks_with_apexes_on_block_borders(tmp_path):
    shape = (256, 256)
    borders = [(63, 64, 25.0, 8), (64, 128, 18.0, 6), (127, 191, 33.0, 10), (192, 63, 9.0, 5), (128, 128, 14.0, 7)]
    data = domes(shape, borders + scattered(1, shape, 80, borders))
    path = write_heights(tmp_path / "h.tif", data)

    whole = find_tree_tops(path, RULE, block=4096)
    rows, cols, heights = local_maxima(data, None, PIXEL, RULE)
    assert pixels(whole) == list(zip(rows.tolist(), cols.tolist(), strict=True))
    assert whole["height"].to_numpy() == pytest.approx(heights)
    for block in (64, 37):
        assert as_records(find_tree_tops(path, RULE, block=block)) == as_records(whole)
    assert {(row, col) for row, col, _, _ in borders} <= set(pixels(whole))
    assert len(set(pixels(whole))) == len(whole) > 20


def test_a_vrt_mosaic_of_two_abutting_scenes_gives_the_whole_raster_s_tops_each_once(tmp_path):
    shape, border = (160, 200), 96
    on_border = [(40, border, 24.0, 8), (100, border - 1, 16.0, 6), (140, border + 1, 30.0, 10)]
    data = domes(shape, on_border + scattered(2, shape, 60, on_border))
    west = write_heights(tmp_path / "west.tif", data[:, :border])
    east = write_heights(tmp_path / "east.tif", data[:, border:], transform=TRANSFORM @ Affine.translation(border, 0))
    vrt = write_mosaic(tmp_path / "mosaic.vrt", [str(west), str(east)])

    whole = find_tree_tops(write_heights(tmp_path / "whole.tif", data), RULE)
    for block in (4096, 48):
        mosaic = find_tree_tops(vrt, RULE, block=block)
        assert as_records(mosaic) == as_records(whole)
    assert {(row, col) for row, col, _, _ in on_border} <= set(pixels(whole))
    assert len(set(pixels(whole))) == len(whole)


def plateau_field(shape: tuple[int, int], rows: slice, cols: slice) -> np.ndarray:
    """A 19 m dome under a flat 20 m rectangle: every rectangle pixel ties for the top."""
    data = domes(shape, [((rows.start + rows.stop) // 2, (cols.start + cols.stop) // 2, 19.0, 40)])
    data[rows, cols] = 20.0
    return data


def test_a_plateau_is_one_top_nearest_its_centroid_whichever_blocks_cut_it(tmp_path):
    data = plateau_field((128, 128), slice(60, 67), slice(61, 71))  # centroid (63, 65.5): ties to column 65
    path = write_heights(tmp_path / "h.tif", data)

    rows, cols, _ = local_maxima(data, None, PIXEL, RULE)
    assert (rows.tolist(), cols.tolist()) == ([63], [65])
    for block in (4096, 64, 32, 5):
        frame = find_tree_tops(path, RULE, block=block)
        assert pixels(frame) == [(63, 65)] and frame["height"].tolist() == [20.0]


def test_a_plateau_wider_than_the_margin_grows_the_halo_and_stays_one_top(tmp_path, caplog):
    data = plateau_field((128, 128), slice(60, 67), slice(40, 91))  # 51 px wide across the column-64 border
    path = write_heights(tmp_path / "h.tif", data)

    with caplog.at_level(logging.WARNING):
        frame = find_tree_tops(path, RULE, block=64, plateau_margin=1)  # the margin doubles up to 32 px
    assert pixels(frame) == [(63, 65)] and not caplog.records
    with caplog.at_level(logging.WARNING):
        find_tree_tops(path, RULE, block=16, plateau_margin=1)  # the margin stops at 8 px: the documented limit
    assert "plateau" in caplog.text


def test_no_data_pixels_are_never_tops_and_never_win_a_window(tmp_path):
    data = domes((96, 96), [(30, 30, 20.0, 8), (70, 70, 15.0, 8)])
    nodata = data.copy()
    nodata[32:35, 29:32] = 9999.0  # beside the first apex, inside its window
    nodata[70, 70] = 9999.0  # the second apex itself
    frame = found(nodata, tmp_path, nodata=9999.0, block=40)
    assert (30, 30) in pixels(frame)
    assert not {(r, c) for r in range(32, 35) for c in range(29, 32)} & set(pixels(frame))
    assert (70, 70) not in pixels(frame) and (frame["height"] < 9999).all()

    nan = data.copy()
    nan[32:35, 29:32], nan[70, 70] = np.nan, np.nan
    assert as_records(found(nan, tmp_path, name="nan.tif")) == as_records(frame)

    masked = tmp_path / "masked.tif"
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True):
        write_heights(masked, nodata)
        with rasterio.open(masked, "r+") as dst:
            dst.write_mask(np.where(nodata == 9999.0, 0, 255).astype(np.uint8))
    assert as_records(find_tree_tops(masked, RULE, block=40)) == as_records(frame)

    valid = nodata != 9999.0
    rows, cols, _ = local_maxima(nodata, valid, PIXEL, RULE)
    assert set(zip(rows.tolist(), cols.tolist(), strict=True)) == set(pixels(frame))


def test_tops_are_written_as_a_geopackage_layer_and_a_geoparquet(tmp_path):
    frame = found(domes((64, 64), [(20, 20, 12.0, 6), (40, 44, 22.0, 8)]), tmp_path)
    write_tree_tops(frame, tmp_path / "out/tops.gpkg", tmp_path / "out/tops.parquet")

    assert pyogrio.list_layers(tmp_path / "out/tops.gpkg")[:, 0].tolist() == [LAYER]
    for back in (
        gpd.read_file(tmp_path / "out/tops.gpkg", layer=LAYER),
        gpd.read_parquet(tmp_path / "out/tops.parquet"),
    ):
        assert as_records(back) == as_records(frame) and back.crs == frame.crs
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tops.gpkg", "tops.parquet"]


def test_a_raster_without_a_tree_gives_an_empty_layer_with_its_crs(tmp_path):
    frame = found(np.full((40, 50), 1.5, dtype=np.float32), tmp_path, block=16)
    assert frame.empty and list(frame.columns) == ["height", "geometry"] and frame.crs == UTM17N
    write_tree_tops(frame, tmp_path / "tops.gpkg", tmp_path / "tops.parquet")
    back = gpd.read_parquet(tmp_path / "tops.parquet")
    assert back.empty and back.crs == UTM17N and gpd.read_file(tmp_path / "tops.gpkg", layer=LAYER).empty


def test_rectangular_pixels_are_refused_and_so_is_a_block_under_one_pixel(tmp_path):
    data = domes((32, 32), [(16, 16, 10.0, 6)])
    with pytest.raises(InputError, match="square pixels"):
        found(data, tmp_path, transform=Affine(0.5, 0, X0, 0, -1.0, Y0))
    with pytest.raises(ValueError, match="block"):
        found(data, tmp_path, block=0)


def points(*xy: tuple[float, float], crs: str = UTM17N) -> gpd.GeoDataFrame:
    return gpd.GeoDataFrame(geometry=[Point(x, y) for x, y in xy], crs=crs)


def test_scores_count_matches_within_the_distance_one_to_one():
    truth = points((0, 0), (10, 0), (20, 0))
    predicted = points((0.5, 0), (10, 0.8), (21.5, 0), (50, 50))  # 0.5 m, 0.8 m, 1.5 m (too far), none

    scores = score_tree_tops(predicted, truth, max_distance=1.0)
    assert scores == {
        "precision": 0.5,
        "recall": pytest.approx(2 / 3),
        "f1": pytest.approx(4 / 7),
        "matched": 2,
        "predicted": 4,
        "true": 3,
        "mean_distance_m": pytest.approx(0.65),
    }
    assert score_tree_tops(predicted, truth, max_distance=1.5)["matched"] == 3

    twice = score_tree_tops(points((0.2, 0), (-0.3, 0)), points((0, 0)))
    assert (twice["matched"], twice["precision"], twice["recall"], twice["mean_distance_m"]) == (1, 0.5, 1.0, 0.2)


def test_matching_is_an_optimal_assignment_not_nearest_first():
    # nearest first pairs (0.1, 0) with (0, 0) and leaves both others alone; the assignment pairs both
    scores = score_tree_tops(points((0.1, 0), (-0.95, 0)), points((0, 0), (1.0, 0)))
    assert scores["matched"] == 2 and scores["mean_distance_m"] == pytest.approx((0.9 + 0.95) / 2)


def test_truth_in_another_crs_is_reprojected_before_matching():
    truth = points((404000, 3285000), (404010, 3285000), (404020, 3285000))
    predicted = points((404000.5, 3285000), (404010, 3285000.8), (404021.5, 3285000), (404050, 3285050))
    in_degrees = truth.to_crs("EPSG:4326")
    assert in_degrees.crs != predicted.crs
    same, reprojected = score_tree_tops(predicted, truth), score_tree_tops(predicted, in_degrees)
    assert reprojected["matched"] == same["matched"] == 2
    assert reprojected["mean_distance_m"] == pytest.approx(same["mean_distance_m"], abs=1e-6)


def test_empty_inputs_score_zero_without_dividing_by_zero():
    none = points()
    truth = points((0, 0), (5, 5))
    assert score_tree_tops(none, truth) == {
        "precision": 0.0,
        "recall": 0.0,
        "f1": 0.0,
        "matched": 0,
        "predicted": 0,
        "true": 2,
        "mean_distance_m": None,
    }
    assert score_tree_tops(truth, none)["predicted"] == 2 and score_tree_tops(truth, none)["precision"] == 0.0
    assert score_tree_tops(none, none)["f1"] == 0.0


@pytest.mark.filterwarnings("ignore:'crs' was not provided")  # nocrs.gpkg: meant
def test_true_tops_are_read_as_points_in_a_crs_else_one_line_naming_the_file_and_feature(tmp_path):
    """read_tree_tops, the dry run's check of scenes.X.tree_tops and the scoring's read: points of any OGR file or
    GeoParquet (the index reset); a feature of another type (crowns drawn instead of tops, a MultiPoint, a line)
    or empty, or a file without a CRS (the tops are reprojected to be matched), is one line naming the file."""
    tops = points((404001, 3284990), (404005, 3284995))
    tops.to_file(tmp_path / "tops.gpkg")
    tops.to_parquet(tmp_path / "tops.parquet")
    for name in ("tops.gpkg", "tops.parquet"):
        read = treetops.read_tree_tops(tmp_path / name)
        assert list(read.index) == [0, 1] and read.crs == UTM17N
        assert [(p.x, p.y) for p in read.geometry] == [(404001, 3284990), (404005, 3284995)]
    need = "tree tops need points (one per tree)"
    hostile = {
        "crowns.gpkg": ([Point(404001, 3284990), Point(404005, 3284995).buffer(2)], UTM17N),
        "multi.gpkg": ([MultiPoint([(404001, 3284990), (404002, 3284990)])], UTM17N),
        "lines.parquet": ([Point(404001, 3284990), LineString([(0, 0), (1, 1)])], UTM17N),
        "empty.gpkg": ([Point(404001, 3284990), Point()], UTM17N),
        "nocrs.gpkg": ([Point(404001, 3284990)], None),
    }
    told = {
        "crowns.gpkg": f"feature 2 is a Polygon (1 of 2 features are no points); {need}",
        "multi.gpkg": f"feature 1 is a MultiPoint (1 of 1 features are no points); {need}",
        "lines.parquet": f"row 1 is a LineString (1 of 2 features are no points); {need}",
        "empty.gpkg": f"feature 2 has an empty geometry (1 such); {need} (draw it, or delete the feature)",
        "nocrs.gpkg": "tree tops have no CRS; they are reprojected to the height's CRS to be matched: set the CRS "
        "they were drawn in",
    }
    for name, (geometries, crs) in hostile.items():
        frame = gpd.GeoDataFrame(geometry=geometries, crs=crs)
        if name.endswith(".parquet"):
            frame.to_parquet(tmp_path / name)
        else:
            frame.to_file(tmp_path / name)
        with pytest.raises(InputError) as raised:
            treetops.read_tree_tops(tmp_path / name)
        assert str(raised.value) == f"{tmp_path / name}: {told[name]}"


def test_matching_scales_to_tens_of_thousands_of_points():
    rng = np.random.default_rng(3)
    true_xy = rng.uniform(0, 3000, size=(30000, 2))
    moved = true_xy + rng.uniform(-0.3, 0.3, size=true_xy.shape)
    truth = gpd.GeoDataFrame(geometry=gpd.points_from_xy(*true_xy.T), crs=UTM17N)
    predicted = gpd.GeoDataFrame(geometry=gpd.points_from_xy(*moved.T), crs=UTM17N)
    scores = score_tree_tops(predicted, truth, max_distance=1.0)
    assert scores["matched"] == 30000 and scores["f1"] == 1.0


def test_the_rule_s_window_grows_with_height_within_its_bounds():
    assert RULE.diameter(np.array([0.0, 20.0, 100.0])).tolist() == pytest.approx([3.0, 5.0, 10.0])
    assert RULE.radius_px(np.array([5.0, 28.0, 100.0]), PIXEL).tolist() == [4, 6, 10]
    assert RULE.max_radius_px(PIXEL) == 10 and RULE.max_radius_px(2.0) == 3 and RULE.max_radius_px(30.0) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_height": 0.0}, "min_height must be > 0"),
        ({"min_height": -1.0}, "min_height must be > 0"),
        ({"min_height": math.nan}, "min_height must be a finite number"),
        ({"min_height": 2.0, "slope": -0.1}, "slope must be >= 0"),
        ({"min_height": 2.0, "min_diameter": 0.0}, "min_diameter must be > 0"),
        (
            {"min_height": 2.0, "min_diameter": 5.0, "max_diameter": 4.0},
            r"max_diameter \(4.0\) must be >= min_diameter",
        ),
        ({"min_height": 2.0, "intercept": math.inf}, "intercept must be a finite number"),
    ],
)
def test_the_rule_rejects_what_cannot_be_a_window(fields, message):
    with pytest.raises(ValueError, match=message):
        TreeTopRule(**fields)
