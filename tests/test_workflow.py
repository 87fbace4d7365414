"""The real workflow, end to end, on the tiny config: synthesis, tiling, 2-rank DDP training and prediction
(CPU ranks over gloo), merge and evaluation."""

import json
import re
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
import pytest
import rasterio
import shapely
import torch
from PIL import Image
from rasterio.windows import Window

from conftest import damage_block
from rasterscale.runtime.precision import choose, probe
from rasterscale.tasks.detection.merge import DETECTION_COLUMNS
from workflow import (
    browser,
    build_report,
    matched_fraction,
    rank_stems,
    rank_tile_ids,
    rendered_dom,
    run_dir,
    run_paths,
    run_workflow,
    table_rows,
    tiny_config,
)

pytestmark = pytest.mark.slow
TRANSFORM = rasterio.Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
RUN = run_paths(tiny_config()).root  # results/tiny: the tiny config's run (model.name tiny)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tiny")
    result = run_workflow(workdir, tiny_config())
    return workdir, result


def unreadable_scene(folder: Path, name: str, width: int, height: int) -> Path:
    """A deflated, tiled GeoTIFF whose header is right and every pixel block is noise: any pixel read fails."""
    path = folder / f"{name}.tif"
    profile = dict(driver="GTiff", width=width, height=height, count=3, dtype="uint8", crs="EPSG:32617")
    profile.update(transform=TRANSFORM, tiled=True, blockxsize=128, blockysize=128, compress="deflate")
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(np.random.default_rng(0).integers(0, 255, (3, height, width), dtype=np.uint8))
    for x in range(-(-width // 128)):
        for y in range(-(-height // 128)):
            damage_block(path, x, y)
    boxes = [shapely.box(404002 + 3 * k, 3284990, 404004 + 3 * k, 3284992) for k in range(5)]
    gpd.GeoDataFrame({"label": ["tree"] * 5}, geometry=boxes, crs="EPSG:32617").to_file(folder / f"{name}.gpkg")
    return path


def test_dry_run_plans_without_reading_pixels(tmp_path):
    """Existing scenes whose every pixel block is damaged (their headers intact) are validated and planned, train
    and predict alike: the dry run reads headers and annotations only, never a pixel."""
    data = tmp_path / "data"
    data.mkdir()
    scenes = {name: unreadable_scene(data, name, 768, 768) for name in ("tiny_train", "tiny_test")}
    with rasterio.open(scenes["tiny_test"]) as src, pytest.raises(rasterio.errors.RasterioIOError):
        src.read(1, window=Window(0, 0, 128, 128))  # the damage is real: a pixel read fails
    config = tiny_config()
    del config["demo"]
    config["scenes"] = {
        name: {"path": str(path), "annotations": str(path.with_suffix(".gpkg"))} for name, path in scenes.items()
    }
    result = run_workflow(tmp_path / "run", config, "-n")
    assert "rule predict:" in result.stdout and "wildcards: batch=0, shard=0" in result.stdout
    assert "rule train:" in result.stdout and "rule tiles_batch_0:" in result.stdout


def test_merged_layer_is_in_the_raster_crs_with_the_expected_columns(tiny_run):
    workdir, _ = tiny_run
    raster = workdir / "resources/demo/tiny_test.tif"
    with rasterio.open(raster) as src:
        crs, bounds = src.crs, src.bounds
    for path in [f"{RUN}/tiny_test/detections.gpkg", f"{RUN}/tiny_test/detections.parquet"]:
        layer = gpd.read_file(workdir / path) if path.endswith("gpkg") else gpd.read_parquet(workdir / path)
        assert layer.crs == crs
        assert list(layer.columns) == DETECTION_COLUMNS
        if len(layer):
            minx, miny, maxx, maxy = layer.total_bounds
            assert bounds.left - 1 <= minx and maxx <= bounds.right + 1
            assert bounds.bottom - 1 <= miny and maxy <= bounds.top + 1


def test_every_tile_processed_exactly_once_across_ranks(tiny_run):
    workdir, _ = tiny_run
    manifest = gpd.read_parquet(workdir / RUN / "tiny_test/tiles.parquet")
    ranks = rank_stems(workdir / RUN, "tiny_test")
    assert [p.name for p in ranks] == ["rank-0", "rank-1"]
    assert all(p.with_suffix(".parquet").exists() for p in ranks)
    processed = [np.asarray(ids) for ids in rank_tile_ids(workdir / RUN, "tiny_test")]
    assert all(len(ids) for ids in processed)  # both ranks did work
    assert sorted(np.concatenate(processed).tolist()) == sorted(manifest["tile_id"].tolist())


def test_training_artifacts_and_batch_sizes(tiny_run):
    workdir, _ = tiny_run
    for suffix in (".pt", ".metrics.csv", ".png"):
        assert (workdir / f"results/models/tiny{suffix}").stat().st_size > 0
    log = (workdir / "logs/train/tiny.log").read_text()
    assert "world_size=2" in log and "per_device_batch=2" in log and "effective_batch=4" in log
    # only rank 0 logs progress to the rule's log; both ranks keep their own log
    assert "rank1 INFO" not in log
    assert (workdir / "logs/train/tiny/rank-1.log").exists()


def test_auto_precision_is_resolved_logged_by_every_rank_and_recorded(tiny_run):
    """precision auto on this CPU: every rank of both jobs logs the value it ran at, and the model file's
    metadata and the prediction profile record it."""
    workdir, _ = tiny_run
    expected = choose(probe("cpu"))
    for job in ("logs/train/tiny", "logs/predict/batch-0/shard-0"):
        for rank in (0, 1):
            text = (workdir / job / f"rank-{rank}.log").read_text()
            section = "train" if "train" in job else "predict"
            assert f"precision: {section}.precision {expected} (auto) on cpu" in text
    assert torch.load(workdir / "results/models/tiny.pt", weights_only=False)["meta"]["precision"] == expected
    profile = json.loads((workdir / RUN / "tiny_test/predict_profile.json").read_text())
    assert {rank["precision"] for rank in profile["ranks"]} == {expected}


def test_evaluation_written(tiny_run):
    workdir, result = tiny_run
    metrics = json.loads((workdir / RUN / "tiny_test/evaluation.json").read_text())
    assert {"precision", "recall", "f1", "map50"} <= set(metrics)
    assert (workdir / RUN / "tiny_test/quicklook.png").stat().st_size > 0
    assert "rasterscale evaluation" in result.stdout + result.stderr


def test_prediction_profile_of_both_ranks_is_gathered_and_printed(tiny_run):
    workdir, result = tiny_run
    profile = json.loads((workdir / RUN / "tiny_test/predict_profile.json").read_text())
    manifest = gpd.read_parquet(workdir / RUN / "tiny_test/tiles.parquet")
    assert [r["rank"] for r in profile["ranks"]] == [0, 1]
    assert all(r["world_size"] == 2 and r["tiles"] > 0 and r["wall_s"] > 0 for r in profile["ranks"])
    assert profile["total"]["tiles"] == len(manifest)
    assert "rasterscale predict profile: tiny_test" in result.stdout + result.stderr
    assert "predict profile, shard 0: 2 rank(s)" in (workdir / "logs/predict/batch-0/shard-0.log").read_text()


def test_one_rank_and_two_ranks_give_the_same_detections(tiny_run, tmp_path):
    workdir, _ = tiny_run
    model = workdir / "results/models/tiny.pt"
    config = tiny_config(model={"file": str(model)}, train={"scenes": []}, predict={"devices": 1})
    run_workflow(tmp_path, config, f"{RUN}/tiny_test/detections.parquet")  # its layer: no scoring, no report
    two = gpd.read_parquet(workdir / RUN / "tiny_test/detections.parquet")
    one = gpd.read_parquet(tmp_path / RUN / "tiny_test/detections.parquet")
    assert len(rank_tile_ids(tmp_path / RUN, "tiny_test")[0]) == len(
        gpd.read_parquet(tmp_path / RUN / "tiny_test/tiles.parquet")
    )
    assert len(two) > 100  # plenty of boxes, many near the score threshold: a real comparison
    assert len(one) == len(two)
    assert matched_fraction(one, two, 0.99) == 1.0 and matched_fraction(two, one, 0.99) == 1.0


@pytest.fixture(scope="module")
def bare_run(tiny_run, tmp_path_factory):
    """A prediction-only run with the tiny model of one unannotated scene of one tile on 2 ranks, and its report:
    the run's folder (results/tiny/ of its work folder: model.file tiny.pt, no model.name) and the report
    (unzipped)."""
    workdir, _ = tiny_run
    config = {
        "scenes": {"bare": {"path": "resources/demo/bare.tif"}},
        "demo": {"scenes": {"bare": {"width": 200, "height": 150, "seed": 7}}},
        "tiling": {"patch_size": 256, "overlap": 64},
        "model": {"file": str(workdir / "results/models/tiny.pt"), "score_threshold": 0.05},
        "predict": {"scenes": ["bare"], "devices": 2, "workers": 0},
    }
    out = tmp_path_factory.mktemp("bare")
    report = build_report(out / "run", config, out)
    return run_dir(out / "run", config), report


def test_more_ranks_than_tiles_still_accounts_for_every_tile(bare_run):
    run, _ = bare_run
    assert run.relative_to(run.parents[1]) == Path("results/tiny")  # named by the model file
    ranks = rank_tile_ids(run, "bare")
    assert ranks == [[0], []]
    assert gpd.read_parquet(run / "bare/detections.parquet").crs.to_epsg() == 32617


def test_environment_check_runs_ranks_on_random_tiles_without_any_raster(tmp_path):
    config = {
        "model": {"backbone": "resnet18"},
        "predict": {"devices": 2, "batch_size": 2, "workers": 0},
        "dummy": {"count": 6, "size": 96, "delay": 0.01},
    }
    run_workflow(tmp_path, config, "check_environment")
    reports = [json.loads((tmp_path / f"results/checks/environment/rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 for r in reports)
    assert sum(r["tiles"] for r in reports) == 6
    assert all(r["tiles_per_s"] > 0 for r in reports)


def decoded(path: Path) -> tuple[int, int]:
    """A picture's size, once every pixel decoded."""
    with Image.open(path) as image:
        image.load()
        return image.size


@pytest.fixture(scope="module")
def tiny_report(tiny_run, tmp_path_factory):
    """`snakemake --report-after-run --report report.zip` after the finished tiny run, unzipped."""
    workdir, _ = tiny_run
    return build_report(workdir, tiny_config(), tmp_path_factory.mktemp("report"))


def test_report_holds_the_run_each_scene_the_training_curves_and_the_project_map(tiny_run, tiny_report):
    """The report of the tiny run: the four categories, and each item with its content: pictures that decode at a
    legible size, tables with the run's own numbers."""
    workdir, _ = tiny_run
    report = tiny_report
    assert sorted(report.categories) == ["1. Run", "2. Scenes", "3. Training", "4. Project"]
    assert {name: list(subcategories) for name, subcategories in report.categories.items()} == {
        "1. Run": ["run"],
        "2. Scenes": ["tiny_test"],
        "3. Training": ["tiny"],
        "4. Project": ["map"],
    }
    assert all(result["caption"].strip() for result in report.results.values())

    run = table_rows(
        report.file(report.items("1. Run", "run")["config, model, precision, launch geometry"]).read_text()
    )
    ran_at = choose(probe("cpu"))
    meta = torch.load(workdir / "results/models/tiny.pt", weights_only=True)["meta"]
    assert ["task", "detection"] in run and ["model", "tiny"] in run
    assert ["model file", "results/models/tiny.pt (trained by this run)"] in run
    assert ["training: steps", str(meta["steps"])] in run and ["backbone", "resnet18"] in run
    assert ["train", "auto", ran_at] in run and ["predict", "auto", ran_at] in run
    assert ["train", "auto", "2", "1", "2", "1", "4 global", "0", "2"] in run  # devices, nodes, ranks, jobs, ...
    assert ["predict", "auto", "2", "1", "2", "1", "2 per rank", "1", "4"] in run

    scene = report.items("2. Scenes", "tiny_test")
    assert set(scene) == {"quicklook", "scores", "prediction profile", "prediction profile (plot)"}
    assert "imagery" in scene["quicklook"]["caption"] and "{{" not in scene["quicklook"]["caption"]
    assert decoded(report.file(scene["quicklook"])) == (900, 700)  # the scene at full size: 900 x 700 px
    metrics = json.loads((workdir / RUN / "tiny_test/evaluation.json").read_text())
    detections = len(pd.read_parquet(workdir / RUN / "tiny_test/detections.parquet", columns=["label"]))
    scores = table_rows(report.file(scene["scores"]).read_text())
    for key in ("f1", "precision", "recall", "map50"):
        assert [key, f"{metrics[key]:.3f}"] in scores
    assert ["ground_truth", f"{metrics['ground_truth']:,}"] in scores
    assert ["tree", f"{detections:,}"] in scores and ["all", f"{detections:,}"] in scores
    profile = json.loads((workdir / RUN / "tiny_test/predict_profile.json").read_text())
    rows = table_rows(report.file(scene["prediction profile"]).read_text())
    for rank in profile["ranks"]:
        row = rows[1 + rank["rank"]]
        assert row[:4] == [str(rank["rank"]), "cpu", "window", str(rank["tiles"])]
        assert f"{rank['tiles_per_s']:.2f}" in row and f"{rank['memory_peak_mb']:.0f}" in row
    assert rows[3][0] == "all" and rows[3][3] == str(profile["total"]["tiles"])
    assert decoded(report.file(scene["prediction profile (plot)"]))[0] >= 1200

    training = report.items("3. Training", "tiny")
    curves = report.file(training["training curves"])
    assert curves.read_bytes() == (workdir / "results/models/tiny.png").read_bytes() and decoded(curves) == (1000, 400)
    assert report.file(training["training curves (CSV)"]).read_text().startswith("epoch,step,")

    project_map = report.items("4. Project", "map")["summary raster, or scene footprints and counts"]
    assert decoded(report.file(project_map)) == (1000, 800)
    counts = json.loads((workdir / RUN / "report/tiny_test/counts.json").read_text())
    assert counts == {"unit": "detections", "counts": {"tree": detections}, "total": detections}


@pytest.mark.skipif(browser() is None, reason="no Chromium on the PATH (Debian: apt-get install chromium)")
def test_report_renders_in_a_headless_browser_with_its_categories_and_a_scenes_items(tiny_report):
    """report.html opened in a headless Chromium: the report's app draws its menu of the four categories and the
    workflow's description (linking each category); shown the category of scenes, it lists the scene's four items."""
    home = rendered_dom(tiny_report.folder / "report.html")
    categories = ["1. Run", "2. Scenes", "3. Training", "4. Project"]
    assert re.findall(r">(\d\. \w+)<", home) == categories * 2  # the menu, then the description's links
    assert ">rasterscale</h1>" in home
    scenes = rendered_dom(tiny_report.folder / "report.html", "app.showCategory('2. Scenes')")
    listed = re.findall(r">(quicklook|scores|prediction profile(?: \(plot\))?)<", scenes)
    assert listed == ["prediction profile", "prediction profile (plot)", "quicklook", "scores"]


def test_report_of_a_prediction_only_run_draws_the_quicklook_of_a_scene_without_annotations(tiny_run, bare_run):
    """A run that predicts with the tiny model an unannotated scene: its batch's scoring job draws its quicklook, its
    scores page says it is not scored, the run page names model.file, and there is no training category."""
    workdir, _ = tiny_run
    run, report = bare_run
    assert sorted(report.categories) == ["1. Run", "2. Scenes", "4. Project"]
    scene = report.items("2. Scenes", "bare")
    assert scene["quicklook"]["job_properties"]["rule"] == "score_batch_0"
    assert decoded(report.file(scene["quicklook"])) == (800, 600)  # 200 x 150 px enlarged to a legible size
    assert "Not scored: the scene has no annotations" in report.file(scene["scores"]).read_text()
    detections = len(pd.read_parquet(run / "bare/detections.parquet", columns=["label"]))
    assert ["all", f"{detections:,}"] in table_rows(report.file(scene["scores"]).read_text())
    page = table_rows(
        report.file(report.items("1. Run", "run")["config, model, precision, launch geometry"]).read_text()
    )
    assert [f"{workdir}/results/models/tiny.pt (model.file)"] == [r[1] for r in page if r[0] == "model file"]
    assert [row[0] for row in page if row[1:2] == ["auto"]] == ["predict", "predict"]  # precision, geometry
