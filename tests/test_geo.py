import numpy as np
import pytest
import shapely
from affine import Affine

from rasterscale.raster.geo import box_pairs, geometries_to_pixel_boxes, pair_ious, pixel_boxes_to_polygons

NORTH_UP = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)


def test_pixel_box_to_crs_polygon_north_up():
    (poly,) = pixel_boxes_to_polygons(np.array([[10, 20, 30, 60]]), NORTH_UP)
    # x = 404000 + 0.1 * col; y = 3285000 - 0.1 * row
    assert poly.bounds == pytest.approx((404001.0, 3284994.0, 404003.0, 3284998.0))
    assert poly.area == pytest.approx(2.0 * 4.0)


def test_tile_offset_then_crs_equals_direct_translation():
    tile_box = np.array([[5.0, 7.0, 25.0, 47.0]])
    col_off, row_off = 320, 640
    raster_box = tile_box + [col_off, row_off, col_off, row_off]
    (poly,) = pixel_boxes_to_polygons(raster_box, NORTH_UP)
    x0, y1 = NORTH_UP @ (col_off + 5, row_off + 7)
    x1, y0 = NORTH_UP @ (col_off + 25, row_off + 47)
    assert poly.bounds == pytest.approx((x0, y0, x1, y1))


def test_rotated_transform_roundtrip():
    transform = Affine.translation(500000, 4000000) @ Affine.rotation(20) @ Affine.scale(0.25, -0.25)
    boxes = np.array([[0, 0, 10, 10], [100.5, 20.25, 140, 90]])
    polys = pixel_boxes_to_polygons(boxes, transform)
    assert shapely.get_coordinates(polys[0])[1] == pytest.approx(transform @ (10, 0))
    assert geometries_to_pixel_boxes(polys, transform) == pytest.approx(boxes)


def test_box_pairs_and_iou():
    boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10], [50, 50, 60, 60]], dtype=float)
    i, j = box_pairs(boxes)
    # touching boxes (0 and 2 share only an edge... they do not; 1 and 2 overlap) have positive-area overlap only
    assert sorted(zip(i.tolist(), j.tolist(), strict=True)) == [(0, 1), (1, 2)]
    assert pair_ious(boxes[[0]], boxes[[1]]) == pytest.approx([50 / 150])
