import os

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import shapely

from conftest import write_rgba
from rasterscale.errors import InputError
from rasterscale.raster.headers import check_raster, has_siblings
from rasterscale.raster.imagery import check_imagery
from rasterscale.tasks.detection.groundtruth import read_annotations


def test_good_raster_passes(raster_factory):
    info = check_raster(raster_factory(width=64, height=64))
    assert (info.width, info.height, info.count) == (64, 64, 3)


def test_tiled_and_striped_rasters_are_told_apart(raster_factory):
    assert check_raster(raster_factory("tiled.tif", width=512, height=512)).is_tiled
    assert not check_raster(raster_factory("striped.tif", width=512, height=512, tiled=False)).is_tiled


@pytest.mark.filterwarnings("ignore::rasterio.errors.NotGeoreferencedWarning")
def test_sidecar_files_are_read_beside_rasters_opened_without_a_folder_listing(raster_factory, tmp_path):
    # a raster alone in its folder is opened without GDAL listing the folder (headers.has_siblings): one with a
    # sidecar is read with it, here an external mask (x.tif.msk) and a world file (x.tfw) giving the georeference
    alone = raster_factory("alone.tif", width=64, height=64)
    masked = raster_factory("masked.tif", width=64, height=64)
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=False), rasterio.open(masked, "r+") as dst:
        dst.write_mask(np.full((64, 64), 255, dtype=np.uint8))
    assert (tmp_path / "masked.tif.msk").exists()
    unplaced = tmp_path / "placed.tif"  # a CRS but no geotransform: its world file places it
    profile = {"driver": "GTiff", "width": 64, "height": 64, "count": 3, "dtype": "uint8", "crs": "EPSG:32617"}
    with rasterio.open(unplaced, "w", **profile) as dst:
        dst.write(np.zeros((3, 64, 64), dtype=np.uint8))
    with pytest.raises(InputError, match=r"placed\.tif: raster has no geotransform"):
        check_raster(unplaced)
    (tmp_path / "placed.tfw").write_text("0.5\n0\n0\n-0.5\n500000.25\n4200000.25\n")
    os.utime(unplaced, ns=(1, 1))  # another version of the file for the headers' cache
    assert not has_siblings(alone) and has_siblings(masked) and has_siblings(unplaced)
    assert not check_raster(alone).dataset_mask and check_raster(masked).dataset_mask
    transform = check_raster(unplaced).transform
    assert (transform.a, transform.c, transform.f) == (0.5, 500000.0, 4200000.5)


def test_missing_raster(tmp_path):
    with pytest.raises(InputError, match=r"nope.tif: raster not found"):
        check_raster(tmp_path / "nope.tif")


def test_not_a_raster(tmp_path):
    path = tmp_path / "junk.tif"
    path.write_text("hello")
    with pytest.raises(InputError, match=r"junk.tif: not a readable raster"):
        check_raster(path)


def test_raster_without_crs(raster_factory):
    with pytest.raises(InputError, match=r"scene.tif: raster has no CRS"):
        check_raster(raster_factory(width=64, height=64, crs=None))


def test_bands_out_of_range_name_the_key(raster_factory):
    info = check_raster(raster_factory(width=64, height=64, count=1))
    expected = r"scene.tif: raster has 1 band\(s\); scenes.a.bands \[1, 2, 3\] asks for band\(s\) 2, 3"
    with pytest.raises(InputError, match=expected):
        check_imagery(info, None, None, "scenes.a")
    check_imagery(info, [1, 1, 1], None, "scenes.a")  # grey as RGB


def test_alpha_band_is_not_a_colour(raster_factory, tmp_path):
    info = check_raster(write_rgba(tmp_path / "rgba.tif", np.full((4, 64, 64), 9, np.uint8)))
    assert info.alpha == 4
    check_imagery(info, None, None, "scenes.a")
    with pytest.raises(InputError, match=r"rgba.tif: band 4 is the alpha band .*scenes.a.bands"):
        check_imagery(info, [1, 2, 4], None, "scenes.a")


def test_16_bit_needs_a_scale_of_matching_length(raster_factory):
    path = raster_factory(width=64, height=64, count=4, data=np.zeros((4, 64, 64), np.uint16))
    info = check_raster(path)
    with pytest.raises(InputError, match=r"scene.tif: bands are uint16, not uint8; set scenes.a.scale"):
        check_imagery(info, None, None, "scenes.a")
    with pytest.raises(InputError, match=r"scenes.a.scale.max has 4 value\(s\) for the 3 bands of scenes.a.bands"):
        check_imagery(info, [4, 3, 2], {"min": 0, "max": [1, 2, 3, 4]}, "scenes.a")
    with pytest.raises(InputError, match=r"scenes.a.scale.min must be below scenes.a.scale.max \(band 3\)"):
        check_imagery(info, [4, 3, 2], {"min": [0, 5, 0], "max": [9, 5, 9]}, "scenes.a")
    with pytest.raises(InputError, match=r"scenes.a.scale.percentile \[98, 2\] must be"):
        check_imagery(info, None, {"percentile": [98, 2]}, "scenes.a")
    check_imagery(info, [4, 3, 2], {"min": 0, "max": [1, 2, 3]}, "scenes.a")
    check_imagery(info, None, {"percentile": [2, 98]}, "scenes.a")


def write_boxes(path, boxes, crs="EPSG:32617", **columns):
    frame = gpd.GeoDataFrame(columns, geometry=[shapely.box(*b) for b in boxes], crs=crs)
    frame.to_file(path, driver="GPKG")
    return path


def test_annotations_in_other_crs_are_reprojected_to_pixels(raster_factory, tmp_path):
    info = check_raster(raster_factory(width=200, height=200))
    utm = gpd.GeoSeries([shapely.box(404001.0, 3284994.0, 404003.0, 3284998.0)], crs="EPSG:32617")
    path = write_boxes(tmp_path / "b.gpkg", [utm.to_crs(4326).iloc[0].bounds], crs="EPSG:4326")
    truth = read_annotations(path, info, ["tree"])
    assert truth.boxes[0] == pytest.approx([10, 20, 30, 60], abs=0.5)


def test_empty_annotation_file(raster_factory, tmp_path):
    info = check_raster(raster_factory(width=64, height=64))
    path = tmp_path / "empty.gpkg"
    gpd.GeoDataFrame({"label": []}, geometry=[], crs="EPSG:32617").to_file(path, driver="GPKG")
    with pytest.raises(InputError, match=r"empty.gpkg: annotation file holds no boxes"):
        read_annotations(path, info, ["tree"])


def test_unknown_label_and_missing_column(raster_factory, tmp_path):
    info = check_raster(raster_factory(width=64, height=64))
    path = write_boxes(tmp_path / "b.gpkg", [(404000.5, 3284995, 404001, 3284999)], label=["bird"])
    with pytest.raises(InputError, match=r"b.gpkg: label\(s\) bird are not in model.labels"):
        read_annotations(path, info, ["tree"], "label")
    with pytest.raises(InputError, match=r"b.gpkg: no column 'species'"):
        read_annotations(path, info, ["tree"], "species")


def test_annotations_outside_the_raster(raster_factory, tmp_path):
    info = check_raster(raster_factory(width=64, height=64))
    path = write_boxes(tmp_path / "far.gpkg", [(0, 0, 1, 1)])
    with pytest.raises(InputError, match=r"far.gpkg: no annotation overlaps the raster"):
        read_annotations(path, info, ["tree"])


CSV_HEADER = "image_path,xmin,ymin,xmax,ymax,label\n"


def test_deepforest_csv_keeps_the_rows_of_the_scene_image(raster_factory, tmp_path, caplog):
    info = check_raster(raster_factory("OSBS_029.tif", width=200, height=200))
    path = tmp_path / "boxes.csv"
    rows = ["OSBS_029.tif,10,20,30,60,Tree", "other.tif,1,1,5,5,Tree", "data/OSBS_029.tif,50,50,90,80,Bird"]
    path.write_text(CSV_HEADER + "\n".join([*rows, "other.tif,2,2,6,6,Tree"]) + "\n")
    with caplog.at_level("WARNING", logger="rasterscale.tasks.detection.groundtruth"):
        truth = read_annotations(path, info, ["Tree", "Bird"], label_column="ignored for CSV")
    assert truth.boxes.tolist() == [[10, 20, 30, 60], [50, 50, 90, 80]]
    assert truth.labels.tolist() == [0, 1] and truth.ignored == 2
    assert "boxes.csv: 2 box(es) of other images than OSBS_029.tif ignored" in caplog.text
    other = read_annotations(path, info, ["Tree"], image_path="other.tif")  # scenes.X.image_path
    assert other.boxes.tolist() == [[1, 1, 5, 5], [2, 2, 6, 6]] and other.ignored == 2


def test_bad_deepforest_csvs_fail_with_one_line(raster_factory, tmp_path):
    info = check_raster(raster_factory(width=200, height=200))
    cases = {
        "empty.csv": ("", r"empty.csv: annotation file holds no boxes"),
        "header.csv": (CSV_HEADER, r"header.csv: annotation file holds no boxes"),
        "columns.csv": ("image_path,x,y\nscene.tif,1,2\n", r"columns.csv: DeepForest CSV lacks column\(s\) xmin, "),
        "other.csv": (
            CSV_HEADER + "a.tif,1,1,5,5,Tree\n",
            r"other.csv: no box for image scene.tif \(it has boxes of a.tif",
        ),
        "label.csv": (
            CSV_HEADER + "scene.tif,1,1,5,5,Bird\n",
            r"label.csv: label\(s\) Bird are not in model.labels \(Tree\)",
        ),
        "box.csv": (CSV_HEADER + "scene.tif,1,1,5,5,Tree\nscene.tif,9,1,5,x,Tree\n", r"box.csv: line 3 has a bad box"),
        "fields.csv": (
            CSV_HEADER + "scene.tif,1,1,5,5,Tree\nscene.tif,1,1,5,5,Tree,Oak\n",
            r"fields.csv: line 3 has more fields than the header",
        ),
        "short.csv": (CSV_HEADER + "scene.tif,1,1,5\n", r"short.csv: line 2 has a bad box \(1, 1, 5, nan\)"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError, match=message):
            read_annotations(tmp_path / name, info, ["Tree"])


def voc(filename: str, objects: list[tuple[str, tuple]]) -> str:
    parts = [f"<annotation><folder>x</folder><filename>{filename}</filename><size><width>200</width></size>"]
    for name, (x0, y0, x1, y1) in objects:
        parts.append(
            f"<object><name>{name}</name><difficult>0</difficult><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin>"
            f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
        )
    return "".join(parts) + "</annotation>"


def test_pascal_voc_xml(raster_factory, tmp_path):
    info = check_raster(raster_factory("crop.tif", width=200, height=200))
    path = tmp_path / "crop.xml"
    path.write_text(voc("crop.tif", [("Tree", (10, 20, 30, 60)), ("Tree", (100, 100, 150, 120))]))
    truth = read_annotations(path, info, ["Tree"])
    assert truth.boxes.tolist() == [[10, 20, 30, 60], [100, 100, 150, 120]] and truth.labels.tolist() == [0, 0]
    path.write_text(voc("crop.png", [("Tree", (10, 20, 30, 60))]))
    assert read_annotations(path, info, ["Tree"], image_path="crop.png").boxes.tolist() == [[10, 20, 30, 60]]
    with pytest.raises(InputError, match=r"crop.xml: no box for image crop.tif \(it has boxes of crop.png"):
        read_annotations(path, info, ["Tree"])


def test_bad_voc_files_fail_with_one_line(raster_factory, tmp_path):
    info = check_raster(raster_factory(width=200, height=200))
    cases = {
        "broken.xml": ("<annotation><filename>scene.tif", r"broken.xml: not a readable XML file"),
        "notvoc.xml": ("<svg></svg>", r"notvoc.xml: not a Pascal VOC file"),
        "none.xml": (voc("scene.tif", []), r"none.xml: annotation file holds no boxes"),
        "label.xml": (
            voc("scene.tif", [("Bird", (1, 1, 5, 5))]),
            r"label.xml: label\(s\) Bird are not in model.labels",
        ),
        "box.xml": (
            voc("scene.tif", [("Tree", (1, 1, 5, 5)), ("Tree", (9, 1, 5, 5))]),
            r"box.xml: <object> 2 has a bad",
        ),
        "nobox.xml": (
            "<annotation><filename>scene.tif</filename><object><name>Tree</name></object></annotation>",
            r"nobox.xml: <object> 1 lacks <name> or <bndbox>",
        ),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError, match=message):
            read_annotations(tmp_path / name, info, ["Tree"])
