"""Tests for the synthetic canopy scene (rasterscale.tools.synth)."""

from __future__ import annotations

from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
from rasterio.crs import CRS
from rasterio.transform import Affine

from rasterscale.tools import synth
from rasterscale.tools.synth import synthesize_scene

WIDTH, HEIGHT = 512, 384
ORIGIN = (404000.0, 3285000.0)
PIXEL = 0.1
DIAMETER = (2.5, 7.0)
TOL = 0.15  # metres: a box is measured in whole pixels


def _make(out: Path, seed: int, **kwargs) -> tuple[Path, Path, int]:
    raster, boxes = out / "scene.tif", out / "nested" / "boxes.gpkg"
    n = synthesize_scene(raster, boxes, width=WIDTH, height=HEIGHT, seed=seed, **kwargs)
    return raster, boxes, n


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    return _make(tmp_path_factory.mktemp("scene"), seed=11, block_size=128)


def _pixels_and_boxes(raster: Path, boxes: Path) -> tuple[np.ndarray, gpd.GeoDataFrame]:
    with rasterio.open(raster) as src:
        pixels = src.read()
    return pixels, gpd.read_file(boxes, layer="crowns")


def test_raster_profile(scene: tuple[Path, Path, int]) -> None:
    raster, _, _ = scene
    with rasterio.open(raster) as src:
        assert (src.width, src.height, src.count) == (WIDTH, HEIGHT, 3)
        assert src.dtypes == ("uint8", "uint8", "uint8")
        assert src.profile["tiled"]
        assert src.block_shapes == [(128, 128)] * 3
        assert src.compression.name == "deflate"
        assert [c.name for c in src.colorinterp] == ["red", "green", "blue"]  # photometric RGB
        assert src.nodata is None
        assert src.crs == CRS.from_epsg(32617)
        assert src.transform.almost_equals(Affine(PIXEL, 0, ORIGIN[0], 0, -PIXEL, ORIGIN[1]))


def test_boxes(scene: tuple[Path, Path, int]) -> None:
    raster, boxes, n = scene
    frame = gpd.read_file(boxes, layer="crowns")
    assert gpd.list_layers(boxes)["name"].tolist() == ["crowns"]
    assert frame.crs == CRS.from_epsg(32617)
    assert n > 10 and len(frame) == n
    assert set(frame["label"]) == {"tree"}
    assert (frame.geom_type == "Polygon").all()
    assert np.allclose(frame.area, frame.envelope.area)  # axis-aligned boxes

    with rasterio.open(raster) as src:
        left, bottom, right, top = src.bounds
    b = frame.bounds
    eps = 1e-6
    assert (b.minx >= left - eps).all() and (b.maxx <= right + eps).all()
    assert (b.miny >= bottom - eps).all() and (b.maxy <= top + eps).all()

    w, h = b.maxx - b.minx, b.maxy - b.miny
    inner = (b.minx > left + eps) & (b.maxx < right - eps) & (b.miny > bottom + eps) & (b.maxy < top - eps)
    assert inner.sum() > n / 2
    for side in (w[inner], h[inner]):  # crowns away from the edge: both sides within the diameter range
        assert side.min() >= DIAMETER[0] - TOL and side.max() <= DIAMETER[1] + TOL
    # Boxes cut by the edge keep at least half their area, so each side keeps at least half its length.
    assert w.min() >= DIAMETER[0] / 2 - TOL and h.min() >= DIAMETER[0] / 2 - TOL
    assert w.max() <= DIAMETER[1] + TOL and h.max() <= DIAMETER[1] + TOL


def test_crowns_are_green_and_visible(scene: tuple[Path, Path, int]) -> None:
    raster, boxes, _ = scene
    pixels, frame = _pixels_and_boxes(raster, boxes)
    r, g, b = pixels.astype(np.float32)
    greenness = g / (r + g + b + 1)  # green share: independent of the (strong) shading on crowns
    inside = np.zeros((HEIGHT, WIDTH), dtype=bool)
    for geom in frame.geometry:
        x0, y0, x1, y1 = geom.bounds
        c0, c1 = round((x0 - ORIGIN[0]) / PIXEL), round((x1 - ORIGIN[0]) / PIXEL)
        r0, r1 = round((ORIGIN[1] - y1) / PIXEL), round((ORIGIN[1] - y0) / PIXEL)
        inside[r0:r1, c0:c1] = True
    assert 0.15 < inside.mean() < 0.85
    assert greenness[inside].mean() - greenness[~inside].mean() > 0.04  # ~0.07 in practice
    # Crowns are darker than the open ground (shade and shadows), and far from flat.
    brightness = pixels.astype(np.float32).mean(axis=0)
    assert brightness[~inside].mean() - brightness[inside].mean() > 15
    assert brightness[inside].std() > 10


def test_deterministic(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    a = _make(tmp_path / "a", seed=5)
    b = _make(tmp_path / "b", seed=5)
    c = _make(tmp_path / "c", seed=6)
    pa, fa = _pixels_and_boxes(a[0], a[1])
    pb, fb = _pixels_and_boxes(b[0], b[1])
    pc, fc = _pixels_and_boxes(c[0], c[1])
    assert a[2] == b[2]
    assert np.array_equal(pa, pb)
    assert fa.geometry.geom_equals_exact(fb.geometry, tolerance=0).all()
    assert not np.array_equal(pa, pc)
    assert len(fa) != len(fc) or not fa.geometry.geom_equals_exact(fc.geometry, tolerance=1e-6).all()


def test_no_temporaries_left(tmp_path: Path) -> None:
    _make(tmp_path, seed=1)
    _make(tmp_path, seed=2)  # overwriting existing outputs works too
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["boxes.gpkg", "nested", "scene.tif"]


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_to_file(self, path, **kwargs) -> None:
        Path(path).write_text("partial")
        raise OSError("disk full")

    monkeypatch.setattr(synth.gpd.GeoDataFrame, "to_file", broken_to_file)
    with pytest.raises(OSError, match="disk full"):
        _make(tmp_path, seed=1)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["nested", "scene.tif"]


def test_tiny_scene_without_crowns(tmp_path: Path) -> None:
    n = synthesize_scene(tmp_path / "t.tif", tmp_path / "t.gpkg", width=8, height=8, seed=0)
    assert n == len(gpd.read_file(tmp_path / "t.gpkg", layer="crowns"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 100},
        {"crown_cover": 0.0},
        {"crown_diameter_m": (5.0, 2.0)},
        {"pixel_size": -0.1},
        {"width": 0},
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    args = {"width": 64, "height": 64, "seed": 0, **kwargs}
    with pytest.raises(ValueError):
        synthesize_scene(tmp_path / "x.tif", tmp_path / "x.gpkg", **args)
    assert not any(tmp_path.iterdir())
