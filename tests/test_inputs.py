import geopandas as gpd
import numpy as np
import pytest
import shapely

from conftest import write_rgba
from rasterscale.inputs import InputError, check_imagery, check_raster, read_annotations


def test_good_raster_passes(raster_factory):
    info = check_raster(raster_factory(width=64, height=64))
    assert (info.width, info.height, info.count) == (64, 64, 3)


def test_tiled_and_striped_rasters_are_told_apart(raster_factory):
    assert check_raster(raster_factory("tiled.tif", width=512, height=512)).is_tiled
    assert not check_raster(raster_factory("striped.tif", width=512, height=512, tiled=False)).is_tiled


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
