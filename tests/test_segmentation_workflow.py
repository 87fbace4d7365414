"""The segmentation task end to end through the real workflow (2 CPU ranks over gloo): a trained segmenter, its
class map as a COG on the raster's grid, no seams at tile edges, the same class map from 2 ranks and from 2 shards x
3 ranks (1 rank against 2: tests/test_exported_models.py), and a merge that refuses a doubled tile naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import rasterio
import yaml
from rasterio.features import rasterize

from borders import BAND_M, TILING, class_maps_near_borders, predict_as_project
from conftest import REPO, report
from rasterscale.jobs.rankfiles import read_tile_ids, write_rank_record
from rasterscale.raster.imagery import read_spec
from rasterscale.tasks.segmentation.modelfiles import read_segmenter_header
from rasterscale.tools.synth import synthesize_scene
from workflow import build_report, rank_stems, run_dir, run_paths, run_workflow, table_rows

TINY = REPO / "tests/configs/tiny_segmentation.yaml"
SEAM_BAND = 16  # px either side of an inner tile edge
BANDS = [1, 2, 3, 4]  # the tiny scenes' red, green, blue and near infrared


def seg_config(**overrides: dict) -> dict:
    config = yaml.safe_load(TINY.read_text())
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


RUN = run_paths(seg_config()).root  # results/tiny_seg: the run's outputs (model.name); a model.file's run keeps it


@pytest.fixture(scope="module")
def seg_run(tmp_path_factory):
    """Train long enough for a useful class map (30 steps: 15 epochs of 2 steps, validated every 5th; half a minute
    on 2 cores, and pixel accuracy about 0.98 away from tile edges), predict with 2 ranks."""
    workdir = tmp_path_factory.mktemp("seg")
    train = {"max_steps": 30, "epochs": 15, "lr": 0.003, "warmup_steps": 5, "batch_size": 4, "val_every_n_epochs": 5}
    config = seg_config(train=train)
    result = run_workflow(workdir, config)
    return workdir, result


def classes_of(workdir) -> np.ndarray:
    with rasterio.open(workdir / RUN / "tiny_test/classes.tif") as src:
        return src.read(1)


def truth_of(workdir) -> np.ndarray:
    import geopandas as gpd

    with rasterio.open(workdir / "resources/demo/tiny_test.tif") as src:
        crowns = gpd.read_file(workdir / "resources/demo/tiny_test.crowns.gpkg").to_crs(src.crs)
        return rasterize(((g, 1) for g in crowns.geometry), out_shape=(src.height, src.width), transform=src.transform)


def test_class_map_is_a_valid_cog_on_the_rasters_grid(seg_run):
    from rio_cogeo.cogeo import cog_validate

    workdir, result = seg_run
    for name in ("classes.tif", "probabilities.tif"):
        valid, errors, _ = cog_validate(str(workdir / RUN / "tiny_test" / name))
        assert valid, errors
    with (
        rasterio.open(workdir / "resources/demo/tiny_test.tif") as src,
        rasterio.open(workdir / RUN / "tiny_test/classes.tif") as out,
    ):
        assert (out.crs, out.transform, out.width, out.height) == (src.crs, src.transform, src.width, src.height)
        assert out.dtypes == ("uint8",) and out.nodata == 255 and out.overviews(1)
    evaluation = json.loads((workdir / RUN / "tiny_test/evaluation.json").read_text())
    assert set(evaluation["iou"]) == {"background", "tree"} and 0 <= evaluation["miou"] <= 1
    assert "rasterscale evaluation (segmentation)" in result.stdout + result.stderr
    import geopandas as gpd

    polygons = gpd.read_file(workdir / RUN / "tiny_test/classes.gpkg", layer="classes")
    assert len(polygons) > 10 and set(polygons["label"]) == {"tree"} and polygons.crs == out.crs


def test_the_model_takes_four_raw_bands_normalized_by_the_training_scenes_statistics(seg_run):
    """normalize: auto: the training scene's statistics (from its manifest's decimated read) stored in the model
    file, which prediction reads; the predicted scene's tiles are raw values too."""
    workdir, _ = seg_run
    bands = read_segmenter_header(workdir / "results/models/tiny_seg.pt").input
    assert bands.names == ("red", "green", "blue", "nir") and bands.raw
    train, test = (read_spec(workdir / RUN / name / "tiles.parquet") for name in ("tiny_train", "tiny_test"))
    assert train.raw and test.raw and train.statistics is not None and test.statistics is not None
    assert bands.mean == pytest.approx(train.statistics.mean) and bands.std == pytest.approx(train.statistics.std)
    nir_crown, nir_ground = 150, 90  # the synthetic scenes' near infrared: crowns bright, ground dark
    assert nir_ground < bands.mean[3] < nir_crown and bands.std[3] > 20
    log = (workdir / "logs/train/tiny_seg.log").read_text()
    assert "4 band(s) [red, green, blue, nir], raw values, mean [" in log


def test_the_profile_counts_the_blend_as_output_not_as_data_wait(seg_run):
    """Each rank's wall splits into compute, output (its tiles' scores blended and blocks written) and the wait for
    data; the blend, a real share of a segmentation rank's time, is output."""
    workdir, _ = seg_run
    profile = json.loads((workdir / RUN / "tiny_test/predict_profile.json").read_text())
    for rank in profile["ranks"]:
        assert rank["output_s"] > 0.01 * rank["wall_s"], rank  # measured 1.9-5 %, by the machine's load
        parts = rank["compute_s"] + rank["output_s"] + rank["wait_s"]
        assert parts == pytest.approx(rank["wall_s"], abs=1e-3) and rank["wait_s"] > 0, rank
    figures = [(r["output_fraction"], r["wait_fraction"]) for r in profile["ranks"]]
    print(f"\n[segmentation] profile per rank (output, data wait): {figures}")


def test_no_seams_at_inner_tile_edges(seg_run):
    import geopandas as gpd

    workdir, _ = seg_run
    classes, truth = classes_of(workdir), truth_of(workdir)
    height, width = classes.shape
    manifest = gpd.read_parquet(workdir / RUN / "tiny_test/tiles.parquet")
    near = np.zeros(classes.shape, dtype=bool)
    cols = np.concatenate([manifest.col_off, manifest.col_off + manifest.width])
    rows = np.concatenate([manifest.row_off, manifest.row_off + manifest.height])
    for edge in np.unique(cols):
        if 0 < edge < width:
            near[:, max(0, edge - SEAM_BAND) : edge + SEAM_BAND] = True
    for edge in np.unique(rows):
        if 0 < edge < height:
            near[max(0, edge - SEAM_BAND) : edge + SEAM_BAND, :] = True
    correct = classes == truth
    at_edges, away = correct[near].mean(), correct[~near].mean()
    print(f"\npixel accuracy within {SEAM_BAND} px of inner tile edges {at_edges:.4f}, away from them {away:.4f}")
    assert away > 0.85  # a model worth measuring seams of
    assert abs(at_edges - away) <= 0.005


@pytest.fixture(scope="module")
def shards_run(seg_run, tmp_path_factory):
    """The trained segmenter over the test scene and over a held-out 1024 px scene of crowns, in one run of 2 shards
    x 3 ranks (6 rank rasters a scene), up to their class maps (no evaluation; no seams: the two scenes overlap, they
    are no survey): the run's work folder, the held-out scene's raster and its crowns' outlines."""
    workdir, _ = seg_run
    run = tmp_path_factory.mktemp("shards")
    shutil.copytree(workdir / "resources", run / "resources")
    raster, outlines = run / "heldout.tif", run / "heldout.crowns.gpkg"
    synthesize_scene(raster, run / "heldout.gpkg", width=1024, height=1024, seed=5, crowns_path=outlines, nir=True)
    predict = {"devices": 3, "shards": 2, "scenes": ["tiny_test", "heldout"]}
    model = {"file": str(workdir / "results/models/tiny_seg.pt")}
    config = seg_config(model=model, train={"scenes": []}, predict=predict, project={"seams": False})
    config["scenes"]["heldout"] = {"path": str(raster), "bands": BANDS}
    assert config["tiling"] == TILING  # the tiling of the held-out scene's project (borders.predict_as_project)
    assert run_dir(run, config) == run / RUN  # model.name kept: the run's outputs are where the fixture's are
    run_workflow(run, config, *(f"{RUN}/{scene}/classes.tif" for scene in ("tiny_test", "heldout")))
    return run, raster, outlines


def test_two_shards_of_three_ranks_give_the_two_rank_class_map(seg_run, shards_run):
    """The trained segmenter's class map of the test scene from 2 shards x 3 ranks (6 rank rasters: other ranks and
    other shards than the fixture's 2 ranks, in one run) is the 2-rank run's: its tiles' scores blend across ranks
    and shards alike. One rank against two is tests/test_exported_models.py's (the same blending, from a TorchScript
    file on 1 rank and an ONNX file on 2)."""
    workdir, _ = seg_run
    two = classes_of(workdir)
    run = shards_run[0]
    equal = float((classes_of(run) == two).mean())
    print(f"\n2 shards x 3 ranks: {equal:.6%} of pixels equal to the 2-rank class map")
    assert equal >= 0.9999
    assert len(rank_stems(run / RUN, "tiny_test", ".tif")) == 6


def test_a_2x2_projects_classes_near_its_inner_borders_score_as_the_whole_scenes(seg_run, shards_run, tmp_path):
    """The trained segmenter over a held-out 1024 px scene of crowns, whole (its class map of ``shards_run``) and as
    2 x 2 abutting scenes: within 2 m of the inner borders the project's classes (seams read across the borders)
    score as the whole scene's, and differ from them in fewer pixels than the four scenes' own class maps side by
    side."""
    workdir, _ = seg_run
    run, raster, outlines = shards_run
    model = {**seg_config()["model"], "file": str(workdir / "results/models/tiny_seg.pt")}
    four = predict_as_project(tmp_path, raster, "segmentation", model, "classes.vrt", bands=BANDS)
    assert four == tmp_path / "four" / RUN
    scores, changed, pixels, cover = class_maps_near_borders(raster, outlines, run / RUN / "heldout/classes.tif", four)
    report(
        f"\n[borders, segmentation] mIoU within {BAND_M:g} m of the inner borders ({pixels} px, {cover:.0%} crowns): "
        + ", ".join(f"{name} {scores[name]:.4f} ({changed[name]} px not the whole scene's class)" for name in scores)
    )
    assert cover > 0.2, "crowns lie across the borders"
    assert scores["whole scene"] >= 0.75, "the segmenter must find the crowns for the comparison to mean anything"
    assert abs(scores["project"] - scores["whole scene"]) <= 0.02
    assert changed["project"] < changed["side by side"], "the seams should read the borders as the whole scene"


def test_merge_refuses_a_doubled_tile_naming_it(seg_run, tmp_path):
    workdir, _ = seg_run
    run = tmp_path / "doubled"
    shutil.copytree(workdir, run, ignore=shutil.ignore_patterns(".snakemake"))
    first, second = rank_stems(run / RUN, "tiny_test", ".tif")
    doubled = int(read_tile_ids(first)[-1])
    write_rank_record(second, [doubled, *read_tile_ids(second).tolist()])
    job = run / RUN / "jobs/merge/batch-0.json"
    record = run / RUN / "batches/merge-0.json"
    record.unlink()  # the run's own: the merge below writes it again only when it succeeds
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/merge.py"), "--job", str(job), "--record", str(record)],
        cwd=run,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert f"duplicated tile_id(s) {doubled} " in result.stderr and "rank-0.json" in result.stderr
    assert not record.exists()  # a merge that fails writes no record: its batch is not done


def test_report_shows_the_class_scores_and_the_pixels_of_each_class(seg_run, tmp_path):
    """The report of the segmentation run: the scene's IoU per class, mIoU and confusion matrix from its evaluation,
    the tree pixels of its class map (background left out, as its polygons leave it out), and the project map."""
    workdir, _ = seg_run
    report = build_report(workdir, yaml.safe_load((workdir / "config.yaml").read_text()), tmp_path)
    assert sorted(report.categories) == ["1. Run", "2. Scenes", "3. Training", "4. Project"]
    scene = report.items("2. Scenes", "tiny_test")
    assert set(scene) == {"quicklook", "scores", "prediction profile", "prediction profile (plot)"}
    metrics = json.loads((workdir / RUN / "tiny_test/evaluation.json").read_text())
    rows = table_rows(report.file(scene["scores"]).read_text())
    assert ["miou", f"{metrics['miou']:.3f}"] in rows and ["pixel_accuracy", f"{metrics['pixel_accuracy']:.3f}"] in rows
    assert ["tree", f"{metrics['iou']['tree']:.3f}"] in rows and [
        "background",
        f"{metrics['iou']['background']:.3f}",
    ] in rows
    (tn, fp), (fn, tp) = metrics["confusion"]
    assert ["true background", f"{tn:,}", f"{fp:,}"] in rows and ["true tree", f"{fn:,}", f"{tp:,}"] in rows
    trees = int((classes_of(workdir) == 1).sum())
    assert ["class", "pixels"] in rows and ["tree", f"{trees:,}"] in rows and ["all", f"{trees:,}"] in rows
    run = table_rows(
        report.file(report.items("1. Run", "run")["config, model, precision, launch geometry"]).read_text()
    )
    assert ["task", "segmentation"] in run and ["classes", "background, tree"] in run
