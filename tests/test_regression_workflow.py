"""The regression task end to end through the real workflow (2 CPU ranks over gloo): a regressor trained on a tiny
synthetic scene whose target (canopy height, m) is a simple function of its pixels, the held-out scene's values.tif
a float32 COG with nodata and overviews on the raster's grid, its tree tops (each once across the tiles' borders),
and evaluation.json with its metrics and the tree tops' scores against the true height's tops."""

from __future__ import annotations

import json

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import yaml
from affine import Affine

from conftest import REPO, UTM17N, report
from rasterscale.tasks.regression.merge import NODATA_VALUE
from rasterscale.tasks.regression.treetops import TreeTopRule, find_tree_tops, local_maxima, write_tree_tops
from workflow import run_paths, run_workflow

pytestmark = pytest.mark.slow

TINY = REPO / "tests/configs/tiny_regression.yaml"


def smooth_field(rng: np.random.Generator, height: int, width: int, cell: int = 24) -> np.ndarray:
    """A smooth random field in [0, 1]: coarse noise upsampled bilinearly."""
    coarse = rng.uniform(0, 1, size=(height // cell + 2, width // cell + 2))
    rows, cols = np.arange(height) / cell, np.arange(width) / cell
    r0, c0 = rows.astype(int), cols.astype(int)
    fr, fc = (rows - r0)[:, None], (cols - c0)[None, :]
    top = coarse[r0][:, c0] * (1 - fc) + coarse[r0][:, c0 + 1] * fc
    bottom = coarse[r0 + 1][:, c0] * (1 - fc) + coarse[r0 + 1][:, c0 + 1] * fc
    return top * (1 - fr) + bottom * fr


def write_scene(folder, name: str, width: int, height: int, seed: int) -> None:
    """An RGB scene and its height: green canopy where the field is high, height 30 m x the green band's share."""
    rng = np.random.default_rng(seed)
    canopy = smooth_field(rng, height, width)
    rgb = np.stack([120 - 60 * canopy, 90 + 120 * canopy, 80 - 30 * canopy]).astype(np.uint8)
    heights = (30.0 * canopy**2).astype(np.float32)
    transform = Affine(0.5, 0, 404000.0, 0, -0.5, 3285000.0)
    common = {"driver": "GTiff", "width": width, "height": height, "crs": UTM17N, "transform": transform}
    folder.mkdir(parents=True, exist_ok=True)
    with rasterio.open(folder / f"{name}.tif", "w", count=3, dtype="uint8", tiled=True, **common) as dst:
        dst.write(rgb)
    with rasterio.open(folder / f"{name}.height.tif", "w", count=1, dtype="float32", nodata=-1.0, **common) as dst:
        heights[:8, :8] = -1.0  # a little no data in the target
        dst.write(heights, 1)


def test_regression_trains_predicts_merges_and_scores_a_tiny_scene(tmp_path, s3_server, monkeypatch):
    """Also over the test scene's raster on S3 (the suite's S3 server, the user's keys in the environment), as a
    second predicted scene: its values are the local scene's."""
    write_scene(tmp_path / "data", "tiny_train", 384, 384, seed=1)
    write_scene(tmp_path / "data", "tiny_test", 640, 576, seed=2)  # wider than a COG block: overviews
    s3_server.create_bucket("regression")
    s3_scene = s3_server.upload(tmp_path / "data/tiny_test.tif", "regression", "tiny_test.tif")
    for key, value in {**s3_server.environment(), **s3_server.credentials()}.items():
        monkeypatch.setenv(key, value)
    rule = {"min_height": 5.0, "intercept": 6.0, "min_diameter": 6.0}  # 0.5 m pixels: windows of 6 m and more
    truth = tmp_path / "data/tiny_test.tops.gpkg"
    true_tops = find_tree_tops(tmp_path / "data/tiny_test.height.tif", TreeTopRule(**rule))
    write_tree_tops(true_tops, truth, truth.with_suffix(".parquet"))
    config = yaml.safe_load(TINY.read_text())
    config["scenes"]["tiny_test"]["tree_tops"] = str(truth)
    config["merge"] = {"tree_tops": rule}
    config["scenes"]["tiny_test_s3"] = {"path": s3_scene}
    config["predict"]["scenes"].append("tiny_test_s3")
    config["project"] = {"seams": False}  # one raster twice: no seam between them
    # up to the scored scene (evaluation.json, quicklook), not the report's run pages and project map
    run = run_paths(config)  # results/tiny_height/: the run (model.name)
    result = run_workflow(tmp_path, config, run.batch_record("score", 0))
    scene = tmp_path / run.scene_dir("tiny_test")
    assert scene == tmp_path / "results/tiny_height/tiny_test"
    values = scene / "values.tif"
    from rio_cogeo.cogeo import cog_validate

    valid, errors, _ = cog_validate(str(values))
    assert valid, errors
    with rasterio.open(tmp_path / "data/tiny_test.tif") as src, rasterio.open(values) as out:
        assert (out.crs, out.transform, out.width, out.height) == (src.crs, src.transform, src.width, src.height)
        assert out.dtypes == ("float32",) and out.nodata == NODATA_VALUE and out.overviews(1)
        assert out.descriptions == ("height",)
        predicted, transform = out.read(1), out.transform
    with rasterio.open(tmp_path / run.scene_dir("tiny_test_s3") / "values.tif") as from_s3:
        assert np.array_equal(from_s3.read(1), predicted) and from_s3.transform == transform
    assert np.isfinite(predicted).all() and (predicted != NODATA_VALUE).all()  # every pixel predicted
    evaluation = json.loads((scene / "evaluation.json").read_text())
    for key in ("mae", "rmse", "bias", "r2"):
        assert isinstance(evaluation[key], float), key
    assert evaluation["pixels"] == 640 * 576 - 64 and set(evaluation["values"]["height"]["by_range"])
    assert (scene / "quicklook.png").stat().st_size > 1000
    tops = gpd.read_parquet(scene / "tree_tops.parquet")
    valid = predicted != NODATA_VALUE
    rows, cols, heights = local_maxima(predicted, valid, 0.5, TreeTopRule(**rule))  # the whole raster at once
    assert len(tops) == len(rows) > 0  # each top once, whatever tile or rank predicted it
    xs, ys = rasterio.transform.xy(transform, rows, cols, offset="center")
    expected = sorted(zip(np.round(xs, 3), np.round(ys, 3), np.round(heights, 4), strict=True))
    found = zip(np.round(tops.geometry.x, 3), np.round(tops.geometry.y, 3), np.round(tops["height"], 4), strict=True)
    assert sorted(found) == expected
    scores = evaluation["tree_tops"]
    assert scores["true"] == len(true_tops) and scores["predicted"] == len(tops) and 0 <= scores["f1"] <= 1
    model = tmp_path / "results/models/tiny_height.pt"
    assert model.exists()
    import torch

    saved = torch.load(model, map_location="cpu", weights_only=True)
    assert saved["task"] == "regression" and len(saved["model"]["target_mean"]) == 1
    assert 2.0 < saved["model"]["target_mean"][0] < 20.0  # the training tiles' heights, measured
    assert "val_mae" in (tmp_path / "results/models/tiny_height.metrics.csv").read_text()
    report(
        f"\n[regression] tiny scene after {config['train']['max_steps']} steps: MAE {evaluation['mae']:.2f} m, "
        f"RMSE {evaluation['rmse']:.2f} m, bias {evaluation['bias']:.2f} m, R² {evaluation['r2']:.3f}; "
        f"tree tops F1 {evaluation['tree_tops']['f1']:.3f} ({len(tops)} found, {len(true_tops)} true)"
    )
    assert "rasterscale evaluation (regression)" in result.stdout + result.stderr
