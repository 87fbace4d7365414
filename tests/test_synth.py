"""Tests for the synthetic canopy scene (rasterscale.tools.synth)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import rasterio.features
import shapely
from rasterio.crs import CRS
from rasterio.transform import Affine
from scipy import ndimage

import demo as entry
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


# ------------------------------------------------------------------------- the same bytes with the new options off

# The pre-change output: computed with the code before the ``nir`` / ``height_path`` / ``tops_path`` options existed
# (commit b2fb9e4), for the scene of ``test_options_off_keep_the_pre_change_output``.
PRE_CHANGE_CROWNS = 7
PRE_CHANGE_SHA256 = "bfbe8960245f640920c91e68d6639d0d2fed8eab3b31a3ad571c777d60a50a31"


def _digest(raster: Path, boxes: Path, crowns: Path) -> str:
    """SHA-256 of the raster's pixels and of the labels and vertex coordinates of the boxes and the outlines."""
    digest = hashlib.sha256()
    with rasterio.open(raster) as src:
        digest.update(src.read().tobytes())
    for path in (boxes, crowns):
        frame = gpd.read_file(path, layer="crowns")
        digest.update("|".join(frame["label"]).encode())
        for geom in frame.geometry:
            digest.update(np.ascontiguousarray(shapely.get_coordinates(geom), dtype=np.float64).tobytes())
    return digest.hexdigest()


def test_options_off_keep_the_pre_change_output(tmp_path: Path) -> None:
    raster, boxes, crowns = tmp_path / "s.tif", tmp_path / "b.gpkg", tmp_path / "c.gpkg"
    n = synthesize_scene(raster, boxes, width=192, height=160, seed=23, block_size=64, crowns_path=crowns)
    assert n == PRE_CHANGE_CROWNS
    assert _digest(raster, boxes, crowns) == PRE_CHANGE_SHA256
    with rasterio.open(raster) as src:
        assert src.count == 3 and src.descriptions == (None, None, None)


# ------------------------------------------------------------------------- near infrared, canopy height, tree tops

RICH_W, RICH_H, RICH_SEED = 400, 320, 7
HEIGHT_RANGE = (6.0, 30.0)  # metres: the crowns' (apex) heights


class Scene:
    """One scene written twice with the same seed: without NIR (``plain``) and with it (``rich``); both with the
    canopy height, the tree tops and the outlines."""

    def __init__(self, out: Path) -> None:
        self.paths = {}
        for name, nir in (("plain", False), ("rich", True)):
            paths = {kind: out / f"{name}.{kind}" for kind in ("tif", "boxes.gpkg", "crowns.gpkg", "chm.tif")}
            paths["tops"] = out / f"{name}.tops.gpkg"
            synthesize_scene(
                paths["tif"],
                paths["boxes.gpkg"],
                width=RICH_W,
                height=RICH_H,
                seed=RICH_SEED,
                block_size=128,
                crowns_path=paths["crowns.gpkg"],
                nir=nir,
                height_path=paths["chm.tif"],
                tops_path=paths["tops"],
            )
            self.paths[name] = paths
        with rasterio.open(self.paths["rich"]["tif"]) as src:
            self.pixels = src.read()
        with rasterio.open(self.paths["rich"]["chm.tif"]) as src:
            self.canopy = src.read(1)
        self.tops = gpd.read_file(self.paths["rich"]["tops"], layer="tree_tops")
        self.outlines = gpd.read_file(self.paths["rich"]["crowns.gpkg"], layer="crowns")


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> Scene:
    return Scene(tmp_path_factory.mktemp("rich"))


def _best_threshold_accuracy(values: np.ndarray, truth: np.ndarray) -> float:
    """Accuracy of the best single threshold on uint8 ``values`` telling ``truth`` from not (either way round)."""
    pos = np.bincount(values[truth], minlength=256).astype(np.float64)
    neg = np.bincount(values[~truth], minlength=256).astype(np.float64)
    # Predict True above t: right are the positives above t and the negatives at or below it.
    right = (pos.sum() - np.cumsum(pos)) + np.cumsum(neg)
    accuracy = right / values.size
    return float(np.maximum(accuracy, 1 - accuracy).max())


def _pixel_of(points: gpd.GeoSeries) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of the pixels the points fall in."""
    cols = np.floor((points.x.to_numpy() - ORIGIN[0]) / PIXEL).astype(int)
    rows = np.floor((ORIGIN[1] - points.y.to_numpy()) / PIXEL).astype(int)
    return rows, cols


def test_nir_raster_profile(rich: Scene) -> None:
    with rasterio.open(rich.paths["rich"]["tif"]) as src:
        assert (src.width, src.height, src.count) == (RICH_W, RICH_H, 4)
        assert src.dtypes == ("uint8",) * 4
        assert src.descriptions == ("red", "green", "blue", "nir")
        assert [c.name for c in src.colorinterp] == ["red", "green", "blue", "undefined"]
        assert src.block_shapes == [(128, 128)] * 4
        assert src.compression.name == "deflate"
        assert src.nodata is None
        assert src.crs == CRS.from_epsg(32617)
        assert src.transform.almost_equals(Affine(PIXEL, 0, ORIGIN[0], 0, -PIXEL, ORIGIN[1]))


def test_nir_leaves_rgb_boxes_outlines_heights_and_tops_alone(rich: Scene) -> None:
    plain, with_nir = rich.paths["plain"], rich.paths["rich"]
    with rasterio.open(plain["tif"]) as a, rasterio.open(with_nir["tif"]) as b:
        assert a.count == 3
        assert np.array_equal(a.read(), b.read((1, 2, 3)))
    for kind in ("boxes.gpkg", "crowns.gpkg"):
        fa, fb = gpd.read_file(plain[kind], layer="crowns"), gpd.read_file(with_nir[kind], layer="crowns")
        assert len(fa) == len(fb) and fa.geometry.geom_equals_exact(fb.geometry, tolerance=0).all()
    with rasterio.open(plain["chm.tif"]) as a, rasterio.open(with_nir["chm.tif"]) as b:
        assert np.array_equal(a.read(), b.read())
    ta, tb = gpd.read_file(plain["tops"]), gpd.read_file(with_nir["tops"])
    assert ta.geometry.geom_equals_exact(tb.geometry, tolerance=0).all() and ta["height"].equals(tb["height"])


def test_nir_separates_crowns_from_ground(rich: Scene) -> None:
    crown = rich.canopy > 0
    assert 0.2 < crown.mean() < 0.6
    nir = rich.pixels[3]
    assert nir[crown].mean() >= 2 * nir[~crown].mean()  # ~2.7x here
    assert 130 < nir[crown].mean() < 200 and 35 < nir[~crown].mean() < 80
    accuracy = [_best_threshold_accuracy(band, crown) for band in rich.pixels]
    assert accuracy[3] > 0.95 and accuracy[3] > max(accuracy[:3]) + 0.05  # 0.97 against 0.87 (blue) here
    smd = []
    for band in rich.pixels.astype(np.float64):
        a, b = band[crown], band[~crown]
        smd.append(abs(a.mean() - b.mean()) / np.sqrt((a.var() + b.var()) / 2))
    assert smd[3] > 1.2 * max(smd[:3])  # 3.4 against 2.4 (blue) here
    # Shaded like the RGB: on crowns, NIR follows the visible brightness (lit side brighter).
    brightness = rich.pixels[:3].astype(np.float64).mean(axis=0)
    assert np.corrcoef(brightness[crown], nir[crown])[0, 1] > 0.6  # 0.76 here


def test_canopy_height_raster(rich: Scene) -> None:
    with rasterio.open(rich.paths["rich"]["chm.tif"]) as src, rasterio.open(rich.paths["rich"]["tif"]) as rgb:
        assert (src.width, src.height, src.count, src.dtypes) == (RICH_W, RICH_H, 1, ("float32",))
        assert src.crs == rgb.crs and src.transform == rgb.transform
        assert src.block_shapes == [(128, 128)] and src.compression.name == "deflate"
        assert src.nodata is None
    canopy = rich.canopy
    assert canopy.min() == 0 and canopy.max() <= HEIGHT_RANGE[1]
    # Each visible outline owns its pixels: heights > 0 inside it, 0 outside all (up to the polygons' vertices).
    owner = rasterio.features.rasterize(
        ((geom, index + 1) for index, geom in enumerate(rich.outlines.geometry)),
        out_shape=canopy.shape,
        transform=Affine(PIXEL, 0, ORIGIN[0], 0, -PIXEL, ORIGIN[1]),
        dtype="int32",
    )
    assert ((canopy > 0) == (owner > 0)).mean() > 0.995
    # A dome per crown: the top of a crown whose apex shows is the highest point of its visible part (less the
    # rim pixel the polygon may give to a neighbour or take from it).
    rows, cols = _pixel_of(rich.tops.geometry)
    assert len(set(owner[rows, cols])) == len(rich.tops) and (owner[rows, cols] > 0).all()
    for index, top in zip(owner[rows, cols], rich.tops["height"], strict=True):
        assert canopy[ndimage.binary_erosion(owner == index)].max() == pytest.approx(top, abs=1e-6)


def test_tree_tops(rich: Scene) -> None:
    tops, canopy = rich.tops, rich.canopy
    assert gpd.list_layers(rich.paths["rich"]["tops"])["name"].tolist() == ["tree_tops"]
    assert tops.crs == CRS.from_epsg(32617) and (tops.geom_type == "Point").all()
    assert len(tops) >= 0.75 * len(rich.outlines)  # 26 of 30: crowns cut by the edge may have their apex outside
    assert tops["height"].between(*HEIGHT_RANGE).all()
    rows, cols = _pixel_of(tops.geometry)
    assert ((rows >= 0) & (rows < RICH_H) & (cols >= 0) & (cols < RICH_W)).all()
    assert np.allclose(tops.geometry.x, ORIGIN[0] + (cols + 0.5) * PIXEL)  # pixel centres
    assert np.allclose(tops.geometry.y, ORIGIN[1] - (rows + 0.5) * PIXEL)
    assert np.array_equal(canopy[rows, cols], tops["height"].to_numpy(dtype=np.float32))

    def local_max(radius_m: float) -> np.ndarray:
        r = round(radius_m / PIXEL)
        yy, xx = np.mgrid[-r : r + 1, -r : r + 1]
        return ndimage.maximum_filter(canopy, footprint=yy * yy + xx * xx <= r * r, mode="constant")

    heights = canopy[rows, cols]
    assert (local_max(0.5)[rows, cols] == heights).all()
    # Within 1 m too, but for the odd small crown whose apex a taller neighbour's crown rim overhangs (~1% of the
    # tops of the demo-sized scenes; none in this one).
    assert (local_max(1.0)[rows, cols] == heights).mean() >= 0.95


def test_entry_script_synthesizes_the_scene_its_job_file_describes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from rasterscale.jobs.files import SynthesisJob
    from rasterscale.settings import job_settings

    paths = {name: tmp_path / name for name in ("s.tif", "b.gpkg", "h.tif", "t.gpkg")}
    scene = {"width": 128, "height": 96, "seed": 3, "nir": True}
    demo = {"directory": str(tmp_path), "crs": "EPSG:32617", "pixel_size": 0.1, "scenes": {"s": scene}}
    SynthesisJob("s", job_settings({"demo": demo})).write(tmp_path / "job.json")
    argv = ["demo", "--job", str(tmp_path / "job.json"), "--raster", str(paths["s.tif"])]
    argv += ["--boxes", str(paths["b.gpkg"]), "--canopy-height", str(paths["h.tif"]), "--tops", str(paths["t.gpkg"])]
    monkeypatch.setattr(sys, "argv", argv)
    entry.main()
    printed = capsys.readouterr().out
    assert "RGB + NIR" in printed and str(paths["h.tif"]) in printed and str(paths["t.gpkg"]) in printed
    with rasterio.open(paths["s.tif"]) as src, rasterio.open(paths["h.tif"]) as chm:
        assert src.count == 4 and (src.width, src.height) == (128, 96) and chm.dtypes == ("float32",)
    assert gpd.list_layers(paths["t.gpkg"])["name"].tolist() == ["tree_tops"]
