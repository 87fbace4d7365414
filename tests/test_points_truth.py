"""The points task's ground truth on real files over a small real raster: GeoPackages and GeoParquet in any CRS
(points, multipoints, polygons as centroids), DeepForest's point and box CSVs and COCO keypoints; every bad file
fails with one line naming the file (and the feature)."""

from __future__ import annotations

import json
import warnings

import geopandas as gpd
import numpy as np
import pytest
import shapely
from affine import Affine

from conftest import write_raster
from rasterscale.errors import InputError
from rasterscale.raster.headers import check_raster
from rasterscale.tasks.points.groundtruth import PointTruth, check_annotations, read_points

WIDTH, HEIGHT = 64, 48
UTM = "EPSG:32633"
X0, Y0, PIXEL = 500000.0, 5000000.0, 0.5
TRANSFORM = Affine(PIXEL, 0, X0, 0, -PIXEL, Y0)
LABELS = ["tree", "snag"]


@pytest.fixture
def raster(tmp_path):
    path = write_raster(tmp_path / "scene.tif", WIDTH, HEIGHT, crs=UTM, transform=TRANSFORM, tiled=False)
    return check_raster(path)


def to_map(col, row):
    """A pixel position (column, row) in the raster's CRS."""
    return X0 + PIXEL * col, Y0 - PIXEL * row


def map_point(col, row):
    return shapely.Point(*to_map(col, row))


def map_box(col0, row0, col1, row1):
    (x0, y0), (x1, y1) = to_map(col0, row1), to_map(col1, row0)
    return shapely.box(x0, y0, x1, y1)


def write_vector(path, geometries, crs=UTM, **columns):
    """A GeoPackage (or GeoParquet, by its suffix) of geometries given in the raster's CRS, written in ``crs``."""
    frame = gpd.GeoDataFrame(columns, geometry=list(geometries), crs=UTM if crs else None)
    if crs and crs != UTM:
        frame = frame.to_crs(crs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'crs' was not provided", UserWarning)  # the file without a CRS
        if str(path).endswith(".parquet"):
            frame.to_parquet(path)
        else:
            frame.to_file(path, driver="GPKG")
    return str(path)


def write_text(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def write_json(path, data):
    return write_text(path, json.dumps(data))


def one_line_error(call, *names):
    """The one line of the InputError ``call`` raises, which must name every one of ``names``."""
    with pytest.raises(InputError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


# --- vector files -----------------------------------------------------------------------------------------------


def test_gpkg_points_in_the_rasters_crs_are_exact_pixels(tmp_path, raster):
    pixels = [(10.5, 20.5), (0.0, 0.0), (63.75, 47.25)]
    path = write_vector(tmp_path / "tops.gpkg", [map_point(c, r) for c, r in pixels])
    truth = read_points(path, raster, LABELS)
    assert isinstance(truth, PointTruth)
    assert truth.xy.dtype == np.float64 and truth.xy.shape == (3, 2)
    np.testing.assert_array_equal(truth.xy, pixels)
    assert truth.labels.dtype == np.int64 and truth.labels.tolist() == [0, 0, 0]
    assert (truth.ignored, truth.centroids) == (0, 0)
    assert check_annotations(path, raster, LABELS, None, "") == []


def test_geoparquet_points_in_wgs84_are_reprojected(tmp_path, raster):
    pixels = [(3.5, 4.5), (32.25, 17.75), (60.5, 40.5)]
    path = write_vector(tmp_path / "tops.parquet", [map_point(c, r) for c, r in pixels], crs="EPSG:4326")
    assert gpd.read_parquet(path).crs.to_epsg() == 4326
    truth = read_points(path, raster, LABELS)
    np.testing.assert_allclose(truth.xy, pixels, rtol=0, atol=1e-6)


def test_multipoints_are_exploded_into_their_points(tmp_path, raster):
    multi = shapely.MultiPoint([to_map(1.5, 2.5), to_map(3.5, 4.5), to_map(5.5, 6.5)])
    path = write_vector(tmp_path / "tops.gpkg", [multi, map_point(7.5, 8.5)], kind=["snag", "tree"])
    truth = read_points(path, raster, LABELS, label_column="kind")
    np.testing.assert_array_equal(truth.xy, [(1.5, 2.5), (3.5, 4.5), (5.5, 6.5), (7.5, 8.5)])
    assert truth.labels.tolist() == [1, 1, 1, 0]
    assert truth.centroids == 0


def test_polygons_are_taken_as_their_centroids_with_one_warning(tmp_path, raster):
    triangle = shapely.Polygon([to_map(30, 30), to_map(36, 30), to_map(30, 36)])  # centroid at (32, 32)
    path = write_vector(tmp_path / "crowns.gpkg", [map_box(10, 10, 14, 16), triangle, map_point(50.5, 5.5)])
    truth = read_points(path, raster, LABELS)
    np.testing.assert_allclose(truth.xy, [(12, 13), (32, 32), (50.5, 5.5)], rtol=0, atol=1e-9)
    assert truth.centroids == 2
    found = check_annotations(path, raster, LABELS, None, "")
    assert found == [
        (
            "centroids_ok",
            f"{path}: 2 of 3 annotations are boxes or polygons: taken as points at their centroids; set "
            "scenes.{scene}.centroids_ok: true if they are meant",
        )
    ]
    assert "\n" not in found[0][1]


def test_a_line_is_refused_naming_its_feature(tmp_path, raster):
    line = shapely.LineString([to_map(1, 1), to_map(9, 9)])
    path = write_vector(tmp_path / "tops.gpkg", [map_point(1, 1), line])
    message = one_line_error(lambda: read_points(path, raster, LABELS), path, "feature 2", "LineString")
    assert "points need" in message


def test_an_empty_geometry_is_refused_naming_its_feature(tmp_path, raster):
    path = write_vector(tmp_path / "tops.gpkg", [map_point(1, 1), map_point(2, 2), shapely.Point()])
    one_line_error(lambda: read_points(path, raster, LABELS), path, "feature 3", "empty geometry", "points need")
    missing = write_vector(tmp_path / "missing.gpkg", [map_point(1, 1), None])
    one_line_error(lambda: read_points(missing, raster, LABELS), missing, "feature 2", "empty geometry")


def test_a_file_without_crs_or_features_is_refused(tmp_path, raster):
    no_crs = write_vector(tmp_path / "nocrs.gpkg", [map_point(1, 1)], crs=None)
    one_line_error(lambda: read_points(no_crs, raster, LABELS), no_crs, "no CRS")
    empty = str(tmp_path / "empty.gpkg")
    gpd.GeoDataFrame({"kind": []}, geometry=[], crs=UTM).to_file(empty, driver="GPKG")
    one_line_error(lambda: read_points(empty, raster, LABELS), empty, "no points")
    gone = str(tmp_path / "gone.gpkg")
    one_line_error(lambda: read_points(gone, raster, LABELS), gone, "not found")


def test_label_column_maps_classes_and_a_missing_one_lists_the_columns(tmp_path, raster):
    points = [map_point(1.5, 1.5), map_point(2.5, 2.5), map_point(3.5, 3.5)]
    path = write_vector(tmp_path / "tops.gpkg", points, kind=["Snag", "tree", "snag"])
    truth = read_points(path, raster, LABELS, label_column="kind")
    assert truth.labels.tolist() == [1, 0, 1]
    message = one_line_error(lambda: read_points(path, raster, LABELS, label_column="species"), path, "'species'")
    assert "kind" in message
    one_line_error(lambda: read_points(path, raster, ["tree"], label_column="kind"), path, "snag", "model.labels")


def test_geojson_named_json_is_read_as_a_vector_file(tmp_path, raster):
    path = str(tmp_path / "tops.json")
    gpd.GeoDataFrame(geometry=[map_point(5.5, 6.5)], crs=UTM).to_crs("EPSG:4326").to_file(path, driver="GeoJSON")
    np.testing.assert_allclose(read_points(path, raster, LABELS).xy, [(5.5, 6.5)], rtol=0, atol=1e-6)


# --- DeepForest CSV ---------------------------------------------------------------------------------------------


def test_deepforest_point_csv_keeps_its_image_and_counts_the_others(tmp_path, raster):
    path = write_text(
        tmp_path / "points.csv",
        "image_path,x,y,label\n"
        "scene.tif,10.5,20.5,Tree\n"
        "other.tif,1,1,Tree\n"
        "some/folder/scene.tif,30,40,snag\n"
        "other.tif,2,2,Tree\n",
    )
    truth = read_points(path, raster, LABELS)
    np.testing.assert_array_equal(truth.xy, [(10.5, 20.5), (30, 40)])
    assert truth.labels.tolist() == [0, 1]
    assert (truth.ignored, truth.centroids) == (2, 0)
    other = read_points(path, raster, LABELS, image_path="/data/other.tif")
    assert (len(other.xy), other.ignored) == (2, 2)
    message = one_line_error(lambda: read_points(path, raster, LABELS, image_path="third.tif"), path, "third.tif")
    assert "other.tif" in message and "image_path" in message


def test_deepforest_box_csv_gives_the_boxes_centres(tmp_path, raster):
    path = write_text(
        tmp_path / "boxes.csv",
        "image_path,xmin,ymin,xmax,ymax,label\nscene.tif,10,20,14,30,Tree\nscene.tif,40,5,41,6,snag\n",
    )
    truth = read_points(path, raster, LABELS)
    np.testing.assert_array_equal(truth.xy, [(12, 25), (40.5, 5.5)])
    assert truth.labels.tolist() == [0, 1]
    assert truth.centroids == 2
    [(key, line)] = check_annotations(path, raster, LABELS, None, "scene.tif")
    assert key == "centroids_ok" and line.startswith(f"{path}: 2 of 2 annotations are boxes or polygons")


@pytest.mark.parametrize(
    ("header", "missing"),
    [("image_path,x,label", "y"), ("image_path,xmin,ymin,xmax,label", "ymax"), ("name,score", "image_path, x, y")],
)
def test_a_csv_without_point_or_box_columns_names_the_missing_ones(tmp_path, raster, header, missing):
    path = write_text(tmp_path / "bad.csv", f"{header}\n" + ",".join(["1"] * len(header.split(","))) + "\n")
    message = one_line_error(lambda: read_points(path, raster, LABELS), path, f"column(s) {missing}")
    assert "image_path,x,y,label" in message


@pytest.mark.parametrize(
    ("rows", "shown"),
    [
        ("image_path,x,y,label\nscene.tif,1,2,tree\nscene.tif,three,4,tree\n", "line 3 has a bad point (three, 4)"),
        ("image_path,x,y,label\nscene.tif,1,,tree\n", "line 2 has a bad point (1, nan)"),
        ("image_path,xmin,ymin,xmax,ymax,label\nscene.tif,5,1,2,3,tree\n", "line 2 has a bad box (5, 1, 2, 3)"),
    ],
)
def test_a_csv_line_without_numbers_is_named(tmp_path, raster, rows, shown):
    path = write_text(tmp_path / "bad.csv", rows)
    one_line_error(lambda: read_points(path, raster, LABELS), path, shown)


# --- COCO keypoints ---------------------------------------------------------------------------------------------


def coco(annotations, images=None):
    return {
        "images": images
        or [
            {"id": 1, "file_name": "imgs/scene.tif", "width": WIDTH, "height": HEIGHT},
            {"id": 2, "file_name": "other.tif"},
        ],
        "annotations": annotations,
        "categories": [
            {"id": 7, "name": "Tree", "keypoints": ["top"]},
            {"id": 9, "name": "snag", "keypoints": ["top", "base"]},
        ],
    }


def test_coco_keypoints_of_the_image_with_visible_points_and_bbox_centres(tmp_path, raster):
    path = write_json(
        tmp_path / "tops.json",
        coco(
            [
                {"id": 1, "image_id": 1, "category_id": 7, "keypoints": [10.5, 20.5, 2]},
                {"id": 2, "image_id": 1, "category_id": 9, "keypoints": [30, 31, 1, 5, 5, 0]},  # base not labelled
                {"id": 3, "image_id": 2, "category_id": 7, "keypoints": [1, 1, 2, 2, 2, 2]},  # another image
                {"id": 4, "image_id": 1, "category_id": 7, "bbox": [40, 10, 4, 6]},  # box only: its centre
                {"id": 5, "image_id": 1, "category_id": 7, "keypoints": [0, 0, 0]},  # nothing labelled
            ]
        ),
    )
    truth = read_points(path, raster, LABELS)
    np.testing.assert_array_equal(truth.xy, [(10.5, 20.5), (30, 31), (42, 13)])
    assert truth.labels.tolist() == [0, 1, 0]
    assert (truth.ignored, truth.centroids) == (2, 1)
    [(key, line)] = check_annotations(path, raster, LABELS, None, "")
    assert key == "centroids_ok" and "1 of 3 annotations" in line
    other = read_points(path, raster, LABELS, image_path="other.tif")
    assert (len(other.xy), other.ignored) == (2, 3)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "not a readable JSON file"),
        ('{"images": [], "annotations": []}', "not a COCO keypoints file"),
        (json.dumps(coco([{"id": 8, "image_id": 1, "category_id": 7, "keypoints": [1, 2, 2, 3]}])), "annotation 8"),
        (json.dumps(coco([{"id": 8, "image_id": 1, "category_id": 7, "keypoints": [1, "a", 2]}])), "annotation 8"),
        (json.dumps(coco([{"id": 8, "image_id": 1, "category_id": 3, "keypoints": [1, 2, 2]}])), "category_id 3"),
        (json.dumps(coco([{"id": 8, "image_id": 1, "category_id": 7}])), "neither keypoints nor a bbox"),
        (json.dumps(coco([{"id": 8, "image_id": 2, "category_id": 7, "keypoints": [1, 2, 2]}])), "no point of image"),
        (json.dumps(coco([], images=[{"id": 1, "file_name": "a.tif"}])), "no image scene.tif in images (it has a.tif"),
        (json.dumps(coco([], images=[{"id": 1, "file_name": "scene.tif", "width": 640}])), "is 640x48 px"),
    ],
)
def test_a_bad_coco_file_fails_with_one_line(tmp_path, raster, content, said):
    path = write_text(tmp_path / "bad.json", content)
    one_line_error(lambda: read_points(path, raster, LABELS), path, said)


def test_a_coco_keypoints_length_not_a_multiple_of_three_is_named(tmp_path, raster):
    path = write_json(tmp_path / "bad.json", coco([{"id": 8, "image_id": 1, "category_id": 7, "keypoints": [1, 2]}]))
    one_line_error(lambda: read_points(path, raster, LABELS), path, "annotation 8", "2 keypoint value(s)", "of 3")


# --- the raster's frame -----------------------------------------------------------------------------------------


def test_points_off_the_raster_are_left_out_and_none_on_it_is_refused(tmp_path, raster):
    pixels = [(-0.5, 10), (5, 5), (64, 10), (10, 48), (63.99, 47.99), (10, -0.01)]
    path = write_vector(tmp_path / "tops.gpkg", [map_point(c, r) for c, r in pixels])
    truth = read_points(path, raster, LABELS)
    np.testing.assert_allclose(truth.xy, [(5, 5), (63.99, 47.99)], rtol=0, atol=1e-9)
    csv_path = write_text(tmp_path / "off.csv", "image_path,x,y,label\nscene.tif,-1,5,tree\nscene.tif,70,5,tree\n")
    one_line_error(
        lambda: read_points(csv_path, raster, LABELS), csv_path, f"no point lies on the raster {raster.path}"
    )
    box = write_vector(tmp_path / "far.gpkg", [map_box(100, 100, 110, 110)])
    one_line_error(lambda: read_points(box, raster, LABELS), box, "no point lies on the raster")
