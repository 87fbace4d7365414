"""Regression's library: targets resampled window by window onto the scene's grid, the dry-run checks of a target,
the masked loss, streaming metrics against numpy, and the blend and merge of values: the same tiles split over 1, 2
and 3 ranks merge to the same values.tif (a float32 COG with nodata and average overviews)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import rasterio
import torch
from affine import Affine
from rasterio.windows import Window
from rio_cogeo.cogeo import cog_validate

from conftest import UTM17N, project_sources, write_raster
from rasterscale.errors import InputError
from rasterscale.grid.manifest import build_manifest, tile_grid, tiles_from_frame
from rasterscale.grid.tile import Tile
from rasterscale.jobs.files import ProjectJob
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import resolve_spec
from rasterscale.settings import job_settings
from rasterscale.tasks.blending import edge_weights, halo_tiles, tile_cores
from rasterscale.tasks.regression.blend import ValueBlender
from rasterscale.tasks.regression.groundtruth import read_targets
from rasterscale.tasks.regression.merge import NODATA_VALUE, merge_value_rasters
from rasterscale.tasks.regression.metrics import ValueScores, evaluate_values, range_names
from rasterscale.tasks.regression.spec import TREE_TOPS, check_annotations, merge_project, tree_top_rule, write_tops
from rasterscale.tasks.regression.task import masked_loss
from rasterscale.tasks.regression.treetops import read_tree_tops
from segmentation_tiles import split_contiguous

PATCH, OVERLAP = 128, 32
TRANSFORM = Affine(0.5, 0, 404000.0, 0, -0.5, 3285000.0)


def scene(tmp_path, width=300, height=220):
    return write_raster(tmp_path / "scene.tif", width, height, transform=TRANSFORM)


def ramp(width: int, height: int, transform: Affine) -> np.ndarray:
    """A target linear in the map coordinates (bilinear resampling gives it back exactly): 0.1 x + 0.05 y (m)."""
    cols, rows = np.meshgrid(np.arange(width) + 0.5, np.arange(height) + 0.5)
    x, y = transform @ (cols, rows)
    return (0.1 * (x - 404000.0) + 0.05 * (3285000.0 - y)).astype(np.float32)


def write_target(path, data, transform, crs=UTM17N, nodata=None):
    data = data[None] if data.ndim == 2 else data
    profile = {"driver": "GTiff", "width": data.shape[2], "height": data.shape[1], "count": data.shape[0]}
    profile |= {"dtype": data.dtype.name, "crs": crs, "transform": transform, "nodata": nodata}
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(data)
    return path


# --- targets ----------------------------------------------------------------------------------------------------


def test_an_aligned_target_is_read_as_it_is_with_its_nodata_as_nan(tmp_path):
    raster = scene(tmp_path)
    values = ramp(300, 220, TRANSFORM)
    values[10:20, 30:40] = -1.0
    target = read_targets(write_target(tmp_path / "t.tif", values, TRANSFORM, nodata=-1.0), raster, ["height"])
    assert target.aligned
    window = Window(25, 5, 100, 50)
    got = target.read(window)[0]
    expected = values[5:55, 25:125].copy()
    expected[expected == -1.0] = np.nan
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.isnan(got).sum() == 100
    assert np.allclose(got[~np.isnan(got)], expected[~np.isnan(expected)])


def test_a_target_in_another_crs_and_resolution_gives_the_aligned_values_window_by_window(tmp_path):
    """A ramp at 1.5 m in UTM 17N covering part of the scene, and the same ramp in EPSG:3857: each window of the
    scene (0.5 m) reads the ramp's values at its pixel centres (bilinear), NaN outside the target's extent."""
    raster = scene(tmp_path)
    coarse = Affine(1.5, 0, 404010.0, 0, -1.5, 3285000.0)  # starts 20 px (10 m) right of the scene
    target = read_targets(write_target(tmp_path / "t.tif", ramp(60, 60, coarse), coarse), raster, ["height"])
    assert not target.aligned
    truth = ramp(300, 220, TRANSFORM)
    got = np.concatenate([target.read(Window(0, row, 300, 55))[0] for row in range(0, 220, 55)])
    inside = np.zeros_like(truth, dtype=bool)
    inside[1 : 60 * 3 - 1, 21 : 20 + 60 * 3 - 1] = True  # a pixel in from the edges: bilinear needs neighbours
    assert np.isnan(got[:, :19]).all() and np.isnan(got[185:]).all()
    assert np.allclose(got[inside], truth[inside], atol=1e-3)

    from rasterio.warp import calculate_default_transform, reproject

    dst_transform, width, height = calculate_default_transform(UTM17N, "EPSG:3857", 300, 220, *raster_bounds(raster))
    mercator = np.zeros((height, width), dtype=np.float32)
    reproject(truth, mercator, src_transform=TRANSFORM, src_crs=UTM17N, dst_transform=dst_transform,
              dst_crs="EPSG:3857", dst_nodata=-9999.0)  # fmt: skip
    path = write_target(tmp_path / "m.tif", mercator, dst_transform, crs="EPSG:3857", nodata=-9999.0)
    again = read_targets(path, raster, ["height"]).read(Window(40, 40, 200, 120))[0]
    known = np.isfinite(again)
    assert known.mean() > 0.95
    assert np.abs(again[known] - truth[40:160, 40:240][known]).max() < 0.2  # resampled twice


def raster_bounds(path):
    with rasterio.open(path) as src:
        return tuple(src.bounds)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("elsewhere", "does not overlap the scene"),
        ("all_nodata", "holds no data over the scene"),
        ("integer", "uint8; regression needs a float raster of values"),
        ("bands", "has 2 band\\(s\\) but model.labels names 1 output value\\(s\\) \\(height\\)"),
        ("polygons", "regression needs a float raster of target values"),
        ("missing", "regression target raster not found"),
        ("label_column", "label_column is set"),
    ],
)
def test_the_dry_run_refuses_a_bad_target_naming_the_file(tmp_path, case, message):
    raster = check_raster(scene(tmp_path))
    values = ramp(300, 220, TRANSFORM)
    path = tmp_path / f"{case}.tif"
    if case == "elsewhere":
        write_target(path, values, Affine(0.5, 0, 500000.0, 0, -0.5, 3285000.0))
    elif case == "all_nodata":
        write_target(path, np.full_like(values, -1.0), TRANSFORM, nodata=-1.0)
    elif case == "integer":
        write_target(path, (values > 10).astype(np.uint8), TRANSFORM)
    elif case == "bands":
        write_target(path, np.stack([values, values]), TRANSFORM)
    elif case == "polygons":
        path = tmp_path / "crowns.gpkg"
        path.write_text("not read")
    elif case == "label_column":
        write_target(path, values, TRANSFORM)
    column = "height" if case == "label_column" else None
    with pytest.raises(InputError, match=message) as err:
        check_annotations(str(path), raster, ["height"], column, "scene.tif")
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


# --- the loss and the metrics -----------------------------------------------------------------------------------


def test_the_loss_leaves_out_pixels_without_a_target():
    predicted = torch.tensor([[[[1.0, 2.0], [3.0, 100.0]]]], requires_grad=True)
    targets = torch.tensor([[[[2.0, 2.0], [1.0, float("nan")]]]])
    assert masked_loss(predicted, targets, "l1").item() == pytest.approx((1 + 0 + 2) / 3)
    assert masked_loss(predicted, targets, "mse").item() == pytest.approx((1 + 0 + 4) / 3)
    assert masked_loss(predicted, targets, "huber").item() == pytest.approx((0.5 + 0 + 1.5) / 3)
    loss = masked_loss(predicted, targets, "l1")
    loss.backward()
    assert predicted.grad is not None and predicted.grad[0, 0, 1, 1] == 0  # no gradient from the unknown pixel
    none = masked_loss(predicted, torch.full_like(targets, float("nan")), "l1")
    assert none.item() == 0 and none.requires_grad


def numpy_scores(predicted: np.ndarray, true: np.ndarray) -> dict:
    errors = predicted - true
    return {
        "pixels": errors.size,
        "mae": np.abs(errors).mean(),
        "rmse": np.sqrt((errors**2).mean()),
        "bias": errors.mean(),
        "r2": 1 - (errors**2).sum() / ((true - true.mean()) ** 2).sum(),
    }


def test_streamed_scores_equal_numpys_overall_and_by_range():
    rng = np.random.default_rng(3)
    true = rng.uniform(0, 35, size=(300, 200))
    predicted = true + rng.normal(0.5, 2.0, size=true.shape)
    true[:5] = np.nan
    predicted[-5:, :7] = np.nan
    scores = ValueScores()
    for rows in range(0, 300, 64):  # block by block
        scores.add(predicted[rows : rows + 64], true[rows : rows + 64])
    found = scores.scores()
    known = np.isfinite(true) & np.isfinite(predicted)
    for key, value in numpy_scores(predicted[known], true[known]).items():
        assert found[key] == pytest.approx(value, rel=1e-9)
    bins = {"<2": (-np.inf, 2), "2-10": (2, 10), "10-20": (10, 20), ">=20": (20, np.inf)}
    assert list(found["by_range"]) == range_names() == list(bins)
    for name, (low, high) in bins.items():
        chosen = known & (true >= low) & (true < high)
        for key, value in numpy_scores(predicted[chosen], true[chosen]).items():
            assert found["by_range"][name][key] == pytest.approx(value, rel=1e-9)


# --- blend and merge ----------------------------------------------------------------------------------------------


def tile_values(tile: Tile, truth: np.ndarray) -> np.ndarray:
    """A tile's prediction: the truth plus an error that grows toward the tile's edges and differs per tile."""
    rows = slice(tile.row_off, tile.row_off + tile.height)
    cols = slice(tile.col_off, tile.col_off + tile.width)
    r, c = np.meshgrid(np.linspace(-1, 1, tile.height), np.linspace(-1, 1, tile.width), indexing="ij")
    error = (np.abs(r) + np.abs(c)) * (1 + tile.tile_id % 3)
    return np.stack([truth[rows, cols] + error, truth[rows, cols] * 2]).astype(np.float32)


def predict_value_ranks(tiles, truth, out_dir, ranks, crs=UTM17N, shards=1, batch=5):
    """Each rank (of each shard) blends its own and halo tiles, ``batch`` at a time; the rank rasters."""
    height, width = truth.shape
    cores = tile_cores(tiles, width, height)
    paths = []
    for rank, own in enumerate(split_contiguous(tiles, ranks, shards)):
        path = out_dir / f"rank-{rank}.tif"
        todo = halo_tiles(tiles, own, cores)
        blender = ValueBlender(
            todo, set(own), cores, width, height, ["height", "double"], OVERLAP, path, TRANSFORM, crs
        )
        for start in range(0, len(todo), batch):
            chunk = todo[start : start + batch]
            values = np.stack([tile_values(tile, truth) for tile in chunk])
            blender.add_batch([tile.tile_id for tile in chunk], torch.from_numpy(values))
        assert blender.close() == sorted(own)
        paths.append(path)
    return paths


def test_values_split_over_1_2_and_3_ranks_and_2_shards_merge_to_the_numpy_blend(tmp_path):
    """The same tiles and values over 1, 2 and 3 rank rasters, and 2 shards of 2, merge to the same values.tif
    (within float tolerance), equal to the whole raster's weighted mean and within 1e-5 (relative) of the NumPy
    blend the ranks ran before blending on their device; masked pixels are nodata; a float32 COG with nodata and
    average overviews in the scene's CRS."""
    width, height = 400, 300
    data = np.random.default_rng(1).integers(1, 255, size=(3, height, width), dtype=np.uint8)
    data[:, :40, :60] = 0  # no data in a corner
    raster = write_raster(tmp_path / "scene.tif", width, height, transform=TRANSFORM, nodata=0, data=data)
    spec = resolve_spec(raster)
    tiles = tiles_from_frame(build_manifest(raster, PATCH, OVERLAP, skip_nodata=True, spec=spec))
    truth = ramp(width, height, TRANSFORM)
    weighted = np.zeros((2, height, width), dtype=np.float64)
    weights = np.zeros((height, width), dtype=np.float64)
    numpy_sums = np.zeros((2, height, width), dtype=np.float32)  # the blend before it ran on a device: NumPy, fp32
    numpy_weights = np.zeros((height, width), dtype=np.float32)
    for tile in tiles:
        rows, cols = slice(tile.row_off, tile.row_off + tile.height), slice(tile.col_off, tile.col_off + tile.width)
        w = edge_weights(tile, width, height, OVERLAP)
        weighted[:, rows, cols] += tile_values(tile, truth) * w
        weights[rows, cols] += w
        numpy_sums[:, rows, cols] += tile_values(tile, truth) * w
        numpy_weights[rows, cols] += w
    expected = (weighted / weights).astype(np.float32)
    expected[:, :40, :60] = np.nan
    with np.errstate(invalid="ignore"):
        numpy_blend = numpy_sums / numpy_weights
    merged = {}
    for ranks, shards in ((1, 1), (2, 1), (3, 1), (2, 2)):
        folder = tmp_path / f"ranks{ranks}-shards{shards}"
        folder.mkdir()
        out = folder / "values.tif"
        summary = merge_value_rasters(predict_value_ranks(tiles, truth, folder, ranks, shards=shards), raster, spec,
                                      out, ["height", "double"], block=128)  # fmt: skip
        assert summary["pixels"] == width * height - 40 * 60 and summary["nodata_pixels"] == 40 * 60
        valid, errors, _ = cog_validate(str(out))
        assert valid, errors
        with rasterio.open(out) as src:
            assert (src.crs, src.transform, src.width, src.height) == (rasterio.crs.CRS.from_string(UTM17N),
                                                                       TRANSFORM, width, height)  # fmt: skip
            assert src.dtypes == ("float32", "float32") and src.nodata == NODATA_VALUE and src.overviews(1)
            assert src.tags()["OVERVIEW_RESAMPLING"] == "AVERAGE" and src.descriptions == ("height", "double")
            assert json.loads(src.tags()["labels"]) == ["height", "double"]
            values = src.read().astype(np.float32)
        values[values == NODATA_VALUE] = np.nan
        merged[ranks, shards] = values
    valid = ~np.isnan(expected)
    for split, values in merged.items():
        assert np.array_equal(np.isnan(values), np.isnan(expected)), split
        assert np.allclose(values, expected, atol=1e-4, equal_nan=True), split
        assert np.allclose(values[valid], numpy_blend[valid], rtol=1e-5, atol=0), split
        assert np.allclose(values, merged[1, 1], atol=1e-5, equal_nan=True), split


def test_evaluation_of_a_merged_values_raster_streams_against_the_target(tmp_path):
    width, height = 260, 200
    raster = write_raster(tmp_path / "scene.tif", width, height, transform=TRANSFORM)
    truth = ramp(width, height, TRANSFORM)
    target = read_targets(write_target(tmp_path / "t.tif", truth, TRANSFORM), raster, ["height"])
    predicted = truth * 1.1 + 0.3
    predicted[:10] = NODATA_VALUE
    path = write_target(tmp_path / "values.tif", predicted, TRANSFORM, nodata=NODATA_VALUE)
    metrics, histograms = evaluate_values(path, target, ["height"], block=64)
    expected = numpy_scores(predicted[10:].astype(np.float64), truth[10:].astype(np.float64))
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5)
    assert histograms[0].counts.sum() == expected["pixels"]
    assert set(metrics["values"]["height"]["by_range"]) == set(range_names())


def test_a_value_blender_resumed_from_its_parts_writes_the_same_raster(tmp_path):
    """Parts of float values (saved after every tile) of a killed rank, then the rank again from them: the same
    raster, NaN outside the own cores included."""
    width, height = 300, 420
    tiles = [Tile(k, *map(int, row)) for k, row in enumerate(tile_grid(width, height, PATCH, OVERLAP))]
    cores, truth = tile_cores(tiles, width, height), ramp(width, height, TRANSFORM)
    own = {t.tile_id for t in tiles[1:-2]}
    labels = ["height", "double"]

    def run(path, parts=(), stop=None, saved=None):
        done = {tile for part in parts for tile in part[1]}
        todo = halo_tiles(tiles, [i for i in own if i not in done], cores)
        blender = ValueBlender(todo, own, cores, width, height, labels, OVERLAP, path, TRANSFORM, UTM17N,
                               block_rows=16, parts=[p for p, _ in parts], keep_unsaved=saved is not None)  # fmt: skip
        for count, tile in enumerate(todo):
            if count == stop:
                blender.__exit__(KeyboardInterrupt)
                return
            blender.add(tile.tile_id, tile_values(tile, truth))
            if saved is not None:
                part = tmp_path / f"part-{len(saved)}.tif"
                written = blender.save_part(part)
                if written is not None:
                    saved.append((part, written[0]))
        blender.close()

    run(tmp_path / "reference.tif")
    saved: list = []
    run(tmp_path / "rank.tif", stop=len(tiles) // 2, saved=saved)
    assert saved and not (tmp_path / "rank.tif").exists()
    run(tmp_path / "rank.tif", parts=saved, saved=[])
    with rasterio.open(tmp_path / "reference.tif") as a, rasterio.open(tmp_path / "rank.tif") as b:
        assert np.array_equal(a.read(), b.read(), equal_nan=True)
        assert {**a.profile, "nodata": None} == {**b.profile, "nodata": None} and np.isnan(b.nodata)


def test_the_projects_values_are_a_vrt_over_the_scenes_with_the_seams_drawn_over_them(tmp_path):
    left = write_target(tmp_path / "left.tif", np.full((100, 100), 5.0, np.float32), TRANSFORM, nodata=NODATA_VALUE)
    right_transform = Affine(0.5, 0, 404050.0, 0, -0.5, 3285000.0)
    right = write_target(tmp_path / "right.tif", np.full((100, 100), 9.0, np.float32), right_transform,
                         nodata=NODATA_VALUE)  # fmt: skip
    seam_values = np.full((100, 40), NODATA_VALUE, np.float32)
    seam_values[:, 10:30] = 7.0  # the seam predicted its core only
    seam_transform = Affine(0.5, 0, 404040.0, 0, -0.5, 3285000.0)
    seam = write_target(tmp_path / "seam.tif", seam_values, seam_transform, nodata=NODATA_VALUE)
    out = tmp_path / "project/values.vrt"
    sources = [
        {"name": "left+right", "values": str(seam), "crs": UTM17N},  # listed first, drawn last
        {"name": "left", "values": str(left), "crs": UTM17N},
        {"name": "right", "values": str(right), "crs": UTM17N},
    ]
    job = ProjectJob(
        UTM17N,
        ("height",),
        project_sources(sources),
        {"values": str(out)},
        job_settings({"task": "regression", "merge": {}}),
    )
    assert "over 3 value rasters" in merge_project(job)
    with rasterio.open(out) as src:
        assert src.width == 200 and src.dtypes == ("float32",) and src.nodata == NODATA_VALUE
        row = src.read(1)[50]
    assert (row[:90] == 5.0).all() and (row[90:110] == 7.0).all() and (row[110:] == 9.0).all()


def test_a_regressor_file_keeps_its_target_scale_and_refuses_keys_that_contradict_it(tmp_path):
    from rasterscale.config.schema import validate_config
    from rasterscale.errors import ConfigError
    from rasterscale.settings import settings_of
    from rasterscale.tasks.regression.model import build_regressor, load_regressor, save_regressor
    from rasterscale.tasks.regression.modelfiles import RegressorConfig, regressor_of_config

    def of_keys(raw: dict) -> RegressorConfig:
        return regressor_of_config(settings_of(validate_config({"task": "regression", **raw})))

    tiling = {"patch_size": 64, "overlap": 16}
    cfg = of_keys({"model": {"labels": ["height", "cover"], "loss": "huber"}, "tiling": tiling})
    model = build_regressor(cfg).eval()
    model.set_target_scale([12.0, 0.4], [5.0, 0.2])
    path = tmp_path / "regressor.pt"
    saved = save_regressor(model, cfg, path, steps=1)
    assert saved.target_mean == pytest.approx((12.0, 0.4)) and saved.target_std == pytest.approx((5.0, 0.2))
    header = of_keys({"model": {"file": str(path)}})
    assert header.labels == ("height", "cover") and header.loss == "huber" and header.target_mean == saved.target_mean
    loaded, _, meta = load_regressor(path)
    images = torch.rand(2, 3, 64, 48)
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(images), model(images)) and meta["steps"] == 1
    with pytest.raises(InputError, match=f"{path}: the regressor predicts \\[height, cover\\] but model.labels"):
        of_keys({"model": {"file": str(path), "labels": ["height"]}})
    with pytest.raises(ConfigError, match=r"'model.loss' is l1 but .* was trained with huber"):
        of_keys({"model": {"file": str(path), "loss": "l1"}})
    start = of_keys({"model": {"labels": ["height"]}, "train": {"init": str(path)}})
    assert start.target_mean == () and start.labels == ("height",)  # training measures its own scale


def domes(height: int, width: int, apexes: list[tuple[float, float, float, float]]) -> np.ndarray:
    """A canopy height field: each (row, col, height, radius px) a dome, 0 on the ground."""
    rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
    field = np.zeros((height, width), np.float32)
    for row, col, top, radius in apexes:
        d2 = ((rows - row) ** 2 + (cols - col) ** 2) / radius**2
        field = np.maximum(field, top * np.sqrt(np.clip(1 - d2, 0, None)))
    return field


def test_a_projects_tree_tops_are_found_once_across_a_scene_border(tmp_path):
    """Two abutting scenes' heights (0.5 m pixels) with a crown across their border: each scene's merge finds a top
    at its edge of the cut crown, the project's tops (on its mosaic) hold every crown's top once, at its apex."""
    apexes = [(20.0, 20.0, 18.0, 8.0), (60.0, 100.0, 22.0, 9.0), (35.0, 150.0, 12.0, 6.0), (80.0, 40.0, 9.0, 5.0)]
    field = domes(100, 200, apexes)  # the crown at column 100 lies across the border
    left = write_target(tmp_path / "left.tif", field[:, :100], TRANSFORM, nodata=NODATA_VALUE)
    right_transform = Affine(0.5, 0, 404050.0, 0, -0.5, 3285000.0)
    right = write_target(tmp_path / "right.tif", field[:, 100:], right_transform, nodata=NODATA_VALUE)
    settings = job_settings({"task": "regression", "merge": {"tree_tops": {"min_height": 5.0}}})
    sources = [
        {"name": "left", "values": str(left), "crs": UTM17N},
        {"name": "right", "values": str(right), "crs": UTM17N},
    ]
    outputs = {
        "values": str(tmp_path / "project/values.vrt"),
        **{k: str(tmp_path / "project" / v) for k, v in TREE_TOPS.items()},
    }
    line = merge_project(ProjectJob(UTM17N, ("height",), project_sources(sources), outputs, settings))
    assert "4 tree tops ->" in line
    tops = read_tree_tops(outputs["tops_gpkg"])
    found = sorted((round(p.y, 2), round(p.x, 2), h) for p, h in zip(tops.geometry, tops["height"], strict=True))
    expected = sorted(
        (3285000.0 - 0.5 * (row + 0.5), 404000.0 + 0.5 * (col + 0.5), float(field[int(row), int(col)]))
        for row, col, _, _ in apexes
    )
    np.testing.assert_allclose(np.array(found), np.array(expected), atol=1e-3)
    per_scene = 0
    for name, values in (("left", left), ("right", right)):
        scene = {"values": str(values), **{k: str(tmp_path / name / v) for k, v in TREE_TOPS.items()}}
        write_tops(values, tree_top_rule(settings.merge.tree_tops), scene)
        per_scene += len(read_tree_tops(scene["tops"]))
    assert per_scene == 5  # the cut crown seen twice, once from each side: the project's layer holds it once
