"""Projects through real `snakemake` runs: a survey of abutting scenes grows, shrinks and is reordered, and only
what changed is predicted again (batches stay put: rasterscale/workflow/batches.py), its project layer partitioned
(project.partition_scenes: 1): only the partitions the new scenes touch are written again."""

from __future__ import annotations

import re
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
from affine import Affine

from conftest import report, write_raster
from prediction import PredictScene
from workflow import jobs_planned, run_workflow

SIDE = 48  # px a scene: one tile each (the model's patch is 128 px)
COLUMNS = 10
SURVEYED = 20  # the survey's first scenes: 2 rows a scene's height apart (no seams)
ADDED = 5  # then a row of 5, each abutting the scene above it (5 seams)


def survey_scene(root: Path, index: int) -> list[str]:
    """Scene ``index`` of the survey: 48 px scenes at 0.1 m, 10 a row, a scene's width apart; the first 2 rows a
    scene's height apart, the rows from the 3rd on abut the row above them (each scene a seam with the one above);
    its scene table row."""
    row, column = divmod(index, COLUMNS)
    name = f"s{index:03d}"
    last = SURVEYED // COLUMNS - 1  # the last row apart from the others
    top = 2 * min(row, last) + max(0, row - last)  # in scene heights
    transform = Affine(0.1, 0, 404000.0 + 2 * column * SIDE * 0.1, 0, -0.1, 3285000.0 - top * SIDE * 0.1)
    data = np.random.default_rng(index).integers(0, 255, (3, SIDE, SIDE), dtype=np.uint8)
    write_raster(root / f"rasters/{name}.tif", SIDE, SIDE, transform=transform, data=data)
    return [name, f"rasters/{name}.tif"]


def write_table(path: Path, rows: list[list[str]]) -> None:
    path.write_text("".join("\t".join(row) + "\n" for row in [["name", "path"], *rows]))


def project_config(model: PredictScene) -> dict:
    return {
        "scenes": "scenes.tsv",
        "model": {"backbone": "resnet18", "file": str(model.model_file), "score_threshold": 0.0},
        "tiling": {"patch_size": model.patch_size, "overlap": model.overlap},
        "predict": {"scenes": "all", "accelerator": "cpu", "workers": 0, "batch_size": 8, "scenes_per_job": 10},
        "project": {"partition_scenes": 1},  # a partitioned layer: a GeoParquet file a batch (a row of the survey)
    }


RUN = "results/model"  # the run of PredictScene's model.pt, given as model.file without model.name: the file's stem
LAYER = f"{RUN}/project/summary.tif"  # the target: the project's summary, over its partitions (no report pages)
PARTITIONS = f"{RUN}/project/detections"  # the partitioned layer: batch-{b}.parquet


def planned_jobs(workdir: Path, config: dict, target: str = LAYER) -> dict[str, int]:
    return jobs_planned(workdir, config, *([target] if target else []))


def output_times(workdir: Path) -> dict[str, int]:
    """Modification times of every scene's and seam's outputs, the batches' job files and prediction folders, by
    their paths in the run's folder (results/{run}/)."""
    run = workdir / RUN
    found = [*run.glob("s*/*"), *run.glob("seams/*/*"), *run.glob("batches/*"), *run.glob("predict/batch-*/shard-*")]
    return {str(path.relative_to(run)): path.stat().st_mtime_ns for path in found}


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    root = tmp_path_factory.mktemp("survey")
    (root / "rasters").mkdir()
    model = PredictScene.make(root / "model")
    rows = [survey_scene(root, index) for index in range(SURVEYED + ADDED)]
    return root, model, rows


def test_adding_scenes_predicts_only_them_and_the_project_and_removing_or_reordering_redoes_nothing(survey):
    root, model, rows = survey
    config = project_config(model)
    write_table(root / "scenes.tsv", rows[:SURVEYED])
    run_workflow(root, config, LAYER)
    before = output_times(root)
    assert sum(path.endswith("/detections.parquet") for path in before) == SURVEYED  # no seams yet

    write_table(root / "scenes.tsv", rows)  # 5 more, each abutting one of the last row: 5 scenes, 5 seams
    jobs = planned_jobs(root, config)
    assert jobs == {
        "tiles_batch_2": 1,
        "predict": 1,
        "merge_batch_2": 1,
        "project_partition": 2,  # the new batch's and the row beside it (its scenes' seams took their borders)
        "summary": 1,
    }, jobs
    partitions = {path.name: path.stat().st_mtime_ns for path in (root / PARTITIONS).glob("*.parquet")}
    run_workflow(root, config, LAYER)
    after = output_times(root)
    changed = sorted(path for path, mtime in before.items() if after[path] != mtime)
    assert changed == [], changed
    rewritten = {path.name: path.stat().st_mtime_ns for path in (root / PARTITIONS).glob("*.parquet")}
    assert rewritten["batch-0.parquet"] == partitions["batch-0.parquet"]  # the first row: untouched
    assert rewritten["batch-1.parquet"] != partitions["batch-1.parquet"] and "batch-2.parquet" in rewritten
    added = sorted(set(after) - set(before))
    new_seams = {path.split("/")[1] for path in added if path.startswith("seams/")}
    assert {path.split("/")[0] for path in added if re.match(r"s\d+/", path)} == {
        f"s{index:03d}" for index in range(SURVEYED, SURVEYED + ADDED)
    }
    above = SURVEYED - COLUMNS  # the first scene of the last row of the survey
    assert new_seams == {f"s{above + k:03d}+s{SURVEYED + k:03d}" for k in range(ADDED)}
    project = gpd.read_parquet(root / PARTITIONS)  # the folder: one layer
    assert set(project["scene"]) == {f"s{index:03d}" for index in range(SURVEYED + ADDED)}
    owners = [set(gpd.read_parquet(path)["source"]) for path in sorted((root / PARTITIONS).glob("*.parquet"))]
    assert sum(map(len, owners)) == len(set().union(*owners))  # each source's objects in one partition only
    assert project.crs == "EPSG:32617"
    with rasterio.open(root / LAYER) as summary:  # every object, per hectare
        area = abs(summary.res[0] * summary.res[1]) / 10_000
        assert summary.read(1).sum() * area == pytest.approx(len(project), rel=1e-4)
    report(
        f"project: {SURVEYED} scenes + {ADDED} added: {len(added)} new outputs, {len(before)} kept with their mtimes"
    )

    reordered = rows[::-1]
    write_table(root / "scenes.tsv", reordered)
    assert planned_jobs(root, config) == {}  # the same scenes in another order: nothing to do
    write_table(root / "scenes.tsv", [row for row in reordered if row[0] != "s003"])
    assert planned_jobs(root, config) == {"project_partition": 1, "summary": 1}  # s003's row only

    # what reads a batch's files depends on the batch's records, not on every scene's files: a scene's deleted
    # layer is remade because rule all names the files gone of a recorded batch, by its batch's merge (and what
    # reads that batch's record)
    (root / RUN / "s006/detections.gpkg").unlink()
    assert planned_jobs(root, config) == {"project_partition": 1, "summary": 1}
    everything = planned_jobs(root, config, target="")
    assert everything.get("merge_batch_0") == 1 and "merge_batch_1" not in everything, everything
    assert "predict" not in everything and "tiles_batch_0" not in everything, everything
    # a deleted manifest: its batch's manifests again, and its prediction and merge since they are newer
    (root / RUN / "s007/tiles.parquet").unlink()
    everything = planned_jobs(root, config, target="")
    assert {name: everything.get(name) for name in ("tiles_batch_0", "predict", "merge_batch_0")} == {
        "tiles_batch_0": 1,
        "predict": 1,
        "merge_batch_0": 1,
    }, everything
    assert "tiles_batch_1" not in everything and "merge_batch_1" not in everything, everything
