"""Crown polygons' ground truth (task instances) and its training dataset, on real files: GeoPackages,
GeoParquet and COCO JSON (polygons, both RLE forms) over small real rasters; every hostile case fails with one
line naming the file and the feature. Also detection's vector boxes, which the same geometry check guards."""

from __future__ import annotations

import json
import pickle
import time
from functools import partial

import geopandas as gpd
import numpy as np
import pytest
import shapely
import shapely.affinity
import torch
from affine import Affine
from rasterio.features import rasterize

from conftest import report, write_raster
from rasterscale.datasets.sampling import Flips
from rasterscale.errors import InputError
from rasterscale.grid.tile import Tile
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import ImageSpec
from rasterscale.tasks.detection.groundtruth import read_annotations
from rasterscale.tasks.instances.dataset import InstanceTileDataset, flip_image_and_masks
from rasterscale.tasks.instances.groundtruth import (
    GroundTruth,
    check_ground_truth,
    decode_rle_string,
    read_ground_truth,
)

SIZE = 256
UTM = "EPSG:32617"
TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)  # conftest.write_raster's: 0.1 m pixels

# pycocotools 2.0.11's mask.encode of DISC rasterized (rasterio, pixel centres) into a 256x256 image: the reference
# that decode_rle_string must agree with (made once outside the suite; pycocotools is no dependency)
DISC = shapely.Point(100.3, 60.7).buffer(20.5)
DISC_RLE = "gQd0;c75K4L3N3M2N2N2N1O2O1N101N10001O0O10000000000001O000O2O0O101N2O0O2N2N2N2N3M2M5K5I[fQ1"


@pytest.fixture
def raster(tmp_path):
    return check_raster(write_raster(tmp_path / "scene.tif", SIZE, SIZE))


def to_map(polygons):
    """Pixel polygons (column, row) in the raster's CRS."""
    return [shapely.affinity.affine_transform(p, TRANSFORM.to_shapely()) for p in polygons]


def write_crowns(path, polygons, crs=UTM, pixels=True, **columns):
    """A vector file of polygons given in pixels (or, ``pixels=False``, as they are), written in ``crs``."""
    geometries = to_map(polygons) if pixels else polygons
    frame = gpd.GeoDataFrame(columns, geometry=geometries, crs=UTM if pixels else crs)
    if pixels and crs != UTM:
        frame = frame.to_crs(crs)
    if str(path).endswith(".parquet"):
        frame.to_parquet(path)
    else:
        frame.to_file(path, driver="GPKG")
    return path


def one_line_error(call, *names):
    """The one line of the InputError ``call`` raises, which must name every one of ``names``."""
    with pytest.raises(InputError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


def coords(polygon):
    return np.asarray(polygon.exterior.coords)


# --- vector files ------------------------------------------------------------------------------------------------


def test_gpkg_crowns_in_pixels_with_their_labels(raster, tmp_path):
    crowns = [DISC, shapely.box(150, 150, 180, 190)]
    path = write_crowns(tmp_path / "crowns.gpkg", crowns, species=["oak", "pine"])
    truth = read_ground_truth(path, raster, ["pine", "oak"], "species")
    assert isinstance(truth, GroundTruth) and truth.ignored == 0
    assert truth.labels.dtype == np.int64 and truth.labels.tolist() == [1, 0]
    for read, drawn in zip(truth.polygons, crowns, strict=True):
        assert isinstance(read, shapely.Polygon) and read.equals_exact(drawn, 1e-6)
    assert read_ground_truth(path, raster, ["tree"]).labels.tolist() == [0, 0]  # no label column: class 0


@pytest.mark.parametrize("name", ["wgs84.gpkg", "wgs84.parquet"])
def test_reprojected_crowns_give_the_same_pixels(raster, tmp_path, name):
    """Vertices are reprojected (not edges), so the round trip UTM -> WGS84 -> UTM is PROJ's transverse Mercator
    accuracy (well under a millimetre) plus float rounding of degrees (1e-16 relative, ~1e-8 m): far below
    0.01 px = 1 mm. The tolerance is that millimetre."""
    crowns = [DISC, shapely.Polygon([(10, 10), (60, 12), (40, 50)])]
    truth = read_ground_truth(write_crowns(tmp_path / name, crowns, crs="EPSG:4326"), raster, ["tree"])
    for read, drawn in zip(truth.polygons, crowns, strict=True):
        assert coords(read) == pytest.approx(coords(drawn), abs=0.01)


def test_crowns_partly_outside_are_clipped_to_the_raster(raster, tmp_path):
    crowns = [shapely.box(-10, 100, 10, 120), shapely.box(250, 250, 270, 260)]
    truth = read_ground_truth(write_crowns(tmp_path / "edge.gpkg", crowns), raster, ["tree"])
    assert [p.bounds for p in truth.polygons] == [(0, 100, 10, 120), (250, 250, 256, 256)]


def test_mendable_rings_are_mended_into_one_polygon(raster, tmp_path):
    # a ring touching itself at (50, 100) (an inverted hole) and a ring overshooting its start (a sliver)
    touching = shapely.Polygon([(0, 0), (100, 0), (100, 100), (50, 100), (70, 50), (30, 50), (50, 100), (0, 100)])
    overshoot = shapely.Polygon([(110, 110), (200, 110), (200, 200), (110, 200), (110, 108), (112, 111)])
    assert not touching.is_valid and not overshoot.is_valid
    truth = read_ground_truth(write_crowns(tmp_path / "mend.gpkg", [touching, overshoot]), raster, ["tree"])
    mended = truth.polygons
    assert all(isinstance(p, shapely.Polygon) and p.is_valid for p in mended)
    assert mended[0].area == pytest.approx(touching.area) and len(mended[0].interiors) == 1
    assert mended[1].area == pytest.approx(90 * 90, rel=1e-3)


HOSTILE = {
    "bowtie.gpkg": (
        [shapely.Polygon([(10, 10), (50, 50), (50, 10), (10, 50)])],
        ["feature 1 is an invalid polygon (Self-intersection", "does not mend into one polygon"],
    ),
    "multi.gpkg": (
        [shapely.box(0, 0, 5, 5), shapely.MultiPolygon([shapely.box(10, 10, 20, 20), shapely.box(30, 30, 40, 40)])],
        ["feature 2 is a MultiPolygon of 2 parts", "a crown is one polygon", "explode them"],
    ),
    "empty.gpkg": ([shapely.box(0, 0, 5, 5), shapely.Polygon()], ["feature 2 has an empty geometry"]),
    "points.gpkg": (
        [shapely.Point(10, 10), shapely.Point(20, 20)],
        ["feature 1 is a Point (2 of 2 features are no polygons)", "crowns need polygons"],
    ),
    "lines.gpkg": ([shapely.LineString([(1, 1), (9, 9)])], ["feature 1 is a LineString", "crowns need polygons"]),
    "outside.gpkg": (
        [shapely.box(10, 10, 20, 20), shapely.box(300, 10, 320, 20), shapely.box(-50, -50, -40, -40)],
        ["2 of 3 polygon(s) lie outside the raster", "(the first: feature 2)"],
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_vector_crowns_fail_with_one_line(raster, tmp_path, name):
    crowns, expected = HOSTILE[name]
    path = write_crowns(tmp_path / name, crowns)
    one_line_error(lambda: read_ground_truth(path, raster, ["tree"]), name, *expected)


@pytest.mark.filterwarnings("ignore:'crs' was not provided")
def test_vector_files_without_crowns_crs_column_or_known_labels(raster, tmp_path):
    empty = tmp_path / "none.gpkg"
    gpd.GeoDataFrame({"species": []}, geometry=[], crs=UTM).to_file(empty, driver="GPKG")
    one_line_error(lambda: read_ground_truth(empty, raster, ["tree"]), "none.gpkg: ground truth holds no polygons")
    nocrs = tmp_path / "nocrs.gpkg"
    gpd.GeoDataFrame(geometry=to_map([DISC])).to_file(nocrs, driver="GPKG")
    one_line_error(lambda: read_ground_truth(nocrs, raster, ["tree"]), "nocrs.gpkg: ground-truth polygons have no CRS")
    labelled = write_crowns(tmp_path / "labelled.gpkg", [DISC], species=["birch"])
    one_line_error(lambda: read_ground_truth(labelled, raster, ["tree"], "kind"), "labelled.gpkg: no column 'kind'")
    one_line_error(
        lambda: read_ground_truth(labelled, raster, ["oak"], "species"), "labelled.gpkg: label(s) birch are not in"
    )
    junk = tmp_path / "junk.gpkg"
    junk.write_text("not a geopackage")
    one_line_error(lambda: read_ground_truth(junk, raster, ["tree"]), "junk.gpkg: not a readable vector file")
    one_line_error(lambda: read_ground_truth(tmp_path / "gone.gpkg", raster, ["tree"]), "gone.gpkg: ", "not found")
    tops = write_crowns(tmp_path / "tops.parquet", [DISC, shapely.Point(5, 5)])  # GeoParquet: rows, from 0
    one_line_error(lambda: read_ground_truth(tops, raster, ["tree"]), "tops.parquet: row 1 is a Point")


def test_check_of_a_few_thousand_crowns_is_cheap(raster, tmp_path):
    centres = np.random.default_rng(1).uniform(5, SIZE - 5, size=(3000, 2))
    crowns = [shapely.Point(x, y).buffer(4, quad_segs=4) for x, y in centres]
    path = write_crowns(tmp_path / "many.gpkg", crowns, species=["tree"] * len(crowns))
    check_ground_truth(path, raster, ["tree"], "species", None)  # warm: imports, pyogrio's driver
    start = time.perf_counter()
    check_ground_truth(path, raster, ["tree"], "species", None)
    elapsed = time.perf_counter() - start
    report(f"check_ground_truth of 3000 crowns (17 vertices each, GeoPackage): {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0


# --- COCO ---------------------------------------------------------------------------------------------------------


def rle_counts(mask):
    """COCO's uncompressed run lengths of a mask: column-major, alternating runs of 0 and 1, 0 first."""
    flat = mask.ravel(order="F")
    changes = np.flatnonzero(np.diff(flat)) + 1
    edges = np.concatenate([[0], changes, [flat.size]])
    runs = np.diff(edges).tolist()
    return runs if flat[0] == 0 else [0, *runs]


def burn(polygon, shape=(SIZE, SIZE)):
    return rasterize([(polygon, 1)], out_shape=shape, fill=0, all_touched=False, dtype="uint8")


def ring(polygon):
    return np.asarray(polygon.exterior.coords)[:-1].ravel().tolist()


def write_coco(path, annotations, images=None, categories=None):
    data = {
        "images": images or [{"id": 7, "file_name": "imgs/scene.tif", "width": SIZE, "height": SIZE}],
        "categories": categories or [{"id": 1, "name": "oak"}, {"id": 2, "name": "pine"}],
        "annotations": [
            {"id": 100 + k, "image_id": 7, "category_id": 1, "iscrowd": 0, **a} for k, a in enumerate(annotations)
        ],
    }
    path.write_text(json.dumps(data))
    return path


def test_coco_rle_string_decodes_as_pycocotools_encodes():
    counts = decode_rle_string("x.json", "annotation 1", DISC_RLE)
    assert counts == rle_counts(burn(DISC))
    assert decode_rle_string("x.json", "annotation 1", "311110003") == [3, 1, 1, 2, 2, 2, 2, 2, 5]  # 4x5, by hand


def test_coco_polygons_and_both_rle_forms(raster, tmp_path, caplog):
    square, triangle = shapely.box(150, 150, 180, 190), shapely.Polygon([(10, 200), (60, 210), (30, 250)])
    mask = burn(DISC)
    annotations = [
        {"segmentation": [ring(square)], "category_id": 2},
        {"segmentation": {"size": [SIZE, SIZE], "counts": DISC_RLE}},
        {"segmentation": {"size": [SIZE, SIZE], "counts": rle_counts(mask)}},
        # two overlapping rings are parts of one crown
        {"segmentation": [ring(shapely.box(200, 10, 230, 40)), ring(shapely.box(220, 30, 250, 60))]},
        {"segmentation": [ring(triangle)], "iscrowd": 1},
    ]
    path = write_coco(tmp_path / "coco.json", annotations)
    data = json.loads(path.read_text())
    data["images"].append({"id": 8, "file_name": "other.tif", "width": SIZE, "height": SIZE})
    data["annotations"].append({"id": 1, "image_id": 8, "category_id": 1, "segmentation": [ring(triangle)]})
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="rasterscale.tasks.instances.groundtruth"):
        truth = read_ground_truth(path, raster, ["pine", "oak"])
    assert "coco.json: 1 crowd annotation(s) (iscrowd) of imgs/scene.tif left out" in caplog.text
    assert truth.ignored == 1 and truth.labels.tolist() == [0, 1, 1, 1]
    polygons = truth.polygons
    assert polygons[0].equals_exact(square, 1e-9) or polygons[0].normalize().equals_exact(square.normalize(), 1e-9)
    for from_rle in polygons[1:3]:  # the mask's outline: burnt again it is the mask; within a pixel of the disc
        assert isinstance(from_rle, shapely.Polygon)
        assert np.array_equal(burn(from_rle), mask)
        assert from_rle.hausdorff_distance(DISC) <= 1.0
        assert from_rle.intersection(DISC).area / from_rle.union(DISC).area > 0.95
    assert polygons[3].area == pytest.approx(2 * 900 - 100)
    other = read_ground_truth(path, raster, ["oak"], image_name="data/other.tif")  # scenes.X.image_path, base name
    assert len(other.polygons) == 1 and other.ignored == 5


def test_coco_rle_of_a_crown_at_the_image_edge(raster, tmp_path):
    crown = shapely.box(240, 0, 256, 30)  # last columns, first rows: runs at both ends of the column-major order
    mask = burn(crown)
    path = write_coco(tmp_path / "edge.json", [{"segmentation": {"size": [SIZE, SIZE], "counts": rle_counts(mask)}}])
    (polygon,) = read_ground_truth(path, raster, ["oak"]).polygons
    assert polygon.normalize().equals_exact(crown.normalize(), 1e-9)


COCO_HOSTILE = {
    "category.json": (
        {"annotations": [{"segmentation": [ring(DISC)], "category_id": 5}]},
        ["annotation 100 has category_id 5, not among categories (1 oak, 2 pine)"],
    ),
    "label.json": (
        {"annotations": [{"segmentation": [ring(DISC)], "category_id": 2}], "labels": ["oak"]},
        ["label(s) pine are not in model.labels (oak)"],
    ),
    "image.json": (
        {
            "annotations": [{"segmentation": [ring(DISC)]}],
            "images": [{"id": 7, "file_name": f"tile_{k}.tif"} for k in range(8)],
        },
        ["no image scene.tif in images (it has tile_0.tif, tile_1.tif, tile_2.tif, tile_3.tif, tile_4.tif and 3 more"],
    ),
    "size.json": (
        {
            "annotations": [{"segmentation": [ring(DISC)]}],
            "images": [{"id": 7, "file_name": "scene.tif", "width": 512, "height": 256}],
        },
        ["image scene.tif is 512x256 px but the raster", "is 256x256 px"],
    ),
    "bowtie.json": (
        {"annotations": [{"segmentation": [[10, 10, 50, 50, 50, 10, 10, 50]]}]},
        ["annotation 100 is an invalid polygon (Self-intersection", "does not mend"],
    ),
    "parts.json": (
        {"annotations": [{"segmentation": [ring(shapely.box(0, 0, 9, 9)), ring(shapely.box(20, 20, 30, 30))]}]},
        ["annotation 100's segmentation has 2 separate parts; a crown is one polygon"],
    ),
    "rlesize.json": (
        {"annotations": [{"segmentation": {"size": [10, 10], "counts": [100]}}]},
        ["annotation 100's mask is [10, 10] (height, width), not the image's [256, 256]"],
    ),
    "rleruns.json": (
        {"annotations": [{"segmentation": {"size": [SIZE, SIZE], "counts": [5, 10]}}]},
        ["annotation 100's mask runs cover 15 pixels, not 256x256"],
    ),
    "rlecut.json": (
        {"annotations": [{"segmentation": {"size": [SIZE, SIZE], "counts": DISC_RLE[:-1]}}]},
        ["annotation 100's mask counts end within a number"],
    ),
    "ring.json": (
        {"annotations": [{"segmentation": [[1, 2, 3, 4]]}]},
        ["annotation 100 has a polygon of 4 value(s)"],
    ),
    "bbox.json": ({"annotations": [{"bbox": [1, 2, 3, 4]}]}, ["annotation 100 has no segmentation"]),
    "outside.json": (
        {"annotations": [{"segmentation": [ring(DISC)]}, {"segmentation": [[300, 300, 310, 300, 310, 310]]}]},
        ["1 of 2 polygon(s) lie outside the raster", "(the first: annotation 101)"],
    ),
}


@pytest.mark.parametrize("name", sorted(COCO_HOSTILE))
def test_hostile_coco_files_fail_with_one_line(raster, tmp_path, name):
    case, expected = COCO_HOSTILE[name]
    path = write_coco(tmp_path / name, case["annotations"], case.get("images"))
    labels = case.get("labels", ["oak", "pine"])
    one_line_error(lambda: read_ground_truth(path, raster, labels), name, *expected)


def test_coco_files_that_are_no_coco(raster, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [')
    one_line_error(lambda: read_ground_truth(broken, raster, ["oak"]), "broken.json: not a readable JSON file")
    other = tmp_path / "other.json"
    other.write_text('{"type": "FeatureCollection", "features": []}')
    one_line_error(lambda: read_ground_truth(other, raster, ["oak"]), "other.json: not a COCO instances file")
    none = write_coco(tmp_path / "none.json", [])
    one_line_error(lambda: read_ground_truth(none, raster, ["oak"]), "none.json: no annotation of image")


# --- detection's boxes: the same geometry check ------------------------------------------------------------------


def test_detection_rejects_points_lines_and_empty_geometries(raster, tmp_path):
    cases = {
        "tops.gpkg": ([shapely.Point(10, 10), shapely.Point(40, 40)], "feature 1 is a Point"),
        "lines.gpkg": ([shapely.box(0, 0, 5, 5), shapely.LineString([(1, 1), (9, 9)])], "feature 2 is a LineString"),
        "empty.gpkg": ([shapely.Polygon(), shapely.box(0, 0, 5, 5)], "feature 1 has an empty geometry"),
    }
    for name, (geometries, expected) in cases.items():
        path = write_crowns(tmp_path / name, geometries)
        one_line_error(partial(read_annotations, path, raster, ["tree"]), name, expected, "boxes need polygons")
    boxes = write_crowns(tmp_path / "boxes.gpkg", [shapely.box(10, 20, 30, 60), DISC])
    np.testing.assert_allclose(read_annotations(boxes, raster, ["tree"]).boxes, [[10, 20, 30, 60], DISC.bounds])


def test_detection_rejects_zero_area_boxes_of_csv_and_voc(raster, tmp_path):
    csv = tmp_path / "flat.csv"
    csv.write_text("image_path,xmin,ymin,xmax,ymax,label\nscene.tif,1,1,5,5,Tree\nscene.tif,10,20,10,40,Tree\n")
    one_line_error(lambda: read_annotations(csv, raster, ["Tree"]), "flat.csv: line 3 has a bad box", "xmin < xmax")
    voc = tmp_path / "flat.xml"
    voc.write_text(
        "<annotation><filename>scene.tif</filename><object><name>Tree</name><bndbox><xmin>5</xmin><ymin>9</ymin>"
        "<xmax>8</xmax><ymax>9</ymax></bndbox></object></annotation>"
    )
    one_line_error(lambda: read_annotations(voc, raster, ["Tree"]), "flat.xml: <object> 1 has a bad box")


# --- the training dataset ------------------------------------------------------------------------------------------

TILE = Tile(tile_id=3, col_off=64, row_off=32, width=96, height=80)


def dataset(raster, polygons, labels=None, **kwargs):
    labels = np.zeros(len(polygons), np.int64) if labels is None else np.asarray(labels, np.int64)
    truth = GroundTruth(np.array(polygons, dtype=object), labels)
    return InstanceTileDataset(raster.path, [TILE], ImageSpec(), truth, **kwargs)


def direct_mask(polygon, tile=TILE):
    """The polygon rasterized straight into the tile's pixels (pixel centres; the tile's own transform)."""
    transform = Affine.translation(tile.col_off, tile.row_off)
    return rasterize([(polygon, 1)], out_shape=(tile.height, tile.width), transform=transform, dtype="uint8")


def extents(masks):
    boxes = []
    for mask in masks:
        rows, cols = np.nonzero(mask)
        boxes.append([cols.min(), rows.min(), cols.max() + 1, rows.max() + 1])
    return np.array(boxes, dtype=np.float32).reshape(-1, 4)


CROWNS = [
    shapely.Point(100.3, 60.7).buffer(15.2),  # inside the tile
    shapely.Polygon([(130, 80), (168, 86), (163, 121), (125, 110)]),  # cut by the tile's right and bottom edges
    shapely.box(56, 70, 76, 90),  # 60% inside (left edge): kept at 0.5
    shapely.box(50, 40, 70, 60),  # 30% inside: dropped
    shapely.box(10, 10, 30, 30),  # outside
]


def test_tile_sample_masks_and_boxes(raster):
    samples = dataset(raster, CROWNS, labels=[0, 1, 0, 1, 1])
    image, target = samples[0]
    assert image.dtype == torch.float32 and image.shape == (3, TILE.height, TILE.width)
    assert float(image.min()) >= 0 and float(image.max()) <= 1
    assert target["labels"].dtype == torch.int64 and target["labels"].tolist() == [0, 1, 0]
    masks = target["masks"].numpy()
    assert masks.dtype == np.uint8 and masks.shape == (3, TILE.height, TILE.width)
    for mask, crown in zip(masks, CROWNS[:3], strict=True):
        assert np.array_equal(mask, direct_mask(crown))
    assert target["boxes"].dtype == torch.float32
    assert target["boxes"].numpy().tolist() == extents(masks).tolist()
    assert target["boxes"][2].tolist() == [0, 38, 12, 58]  # the clipped box of the crown cut by the left edge
    assert len(dataset(raster, CROWNS, min_visible_fraction=0.25)[0][1]["labels"]) == 4  # the 30% one too


def test_tile_without_crowns_and_slivers(raster):
    sliver = shapely.box(63.5, 40, 64.4, 60)  # in the tile, but no pixel centre: no mask, left out
    _, target = dataset(raster, [CROWNS[4], sliver], min_visible_fraction=0.1)[0]
    assert target["masks"].shape == (0, TILE.height, TILE.width) and target["boxes"].shape == (0, 4)
    assert target["labels"].shape == (0,)


@pytest.mark.parametrize("flips", [Flips(True, False), Flips(False, True), Flips(True, True)])
def test_flips_flip_image_masks_and_boxes_alike(raster, flips):
    samples = dataset(raster, CROWNS)
    image, target = samples[0]
    flipped_image, flipped = samples.sample(0, flips)
    dims = [d for d, on in ((-1, flips.horizontal), (-2, flips.vertical)) if on]
    assert torch.equal(flipped_image, image.flip(dims))
    assert torch.equal(flipped["masks"], target["masks"].flip(dims))
    assert torch.equal(flipped["labels"], target["labels"])
    boxes = target["boxes"].numpy().copy()
    if flips.horizontal:
        boxes[:, [0, 2]] = TILE.width - boxes[:, [2, 0]]
    if flips.vertical:
        boxes[:, [1, 3]] = TILE.height - boxes[:, [3, 1]]
    assert flipped["boxes"].numpy().tolist() == boxes.tolist() == extents(flipped["masks"].numpy()).tolist()
    again = flip_image_and_masks(flipped_image, flipped["masks"], flips)
    assert torch.equal(again[0], image) and torch.equal(again[1], target["masks"])


def test_dataset_pickles_for_dataloader_workers(raster):
    samples = dataset(raster, CROWNS)
    expected = samples[0][1]
    copy = pickle.loads(pickle.dumps(samples))
    assert not copy.index.built  # its STRtree is built again in the worker
    got = copy[0][1]
    assert all(torch.equal(got[key], expected[key]) for key in ("boxes", "labels", "masks"))
