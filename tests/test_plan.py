"""The workflow's plan without Snakemake (rasterscale.workflow: plan, paths, jobfiles, slurm, reports) on small real
rasters: what it computes once, its one-line errors, its job files, its Slurm resources, the stored plan a job's
re-parse loads, and that none of it imports torch."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from affine import Affine

import snakemake_forks
from conftest import REPO, write_raster
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.jobs import paths
from rasterscale.jobs.files import JobFileError, MergeJob, PredictJob, ScoreJob, TrainJob
from rasterscale.runtime.preflight import Geometry, PreflightError, srun_prefix
from rasterscale.scene import Imagery, Scene
from rasterscale.settings import Settings, SlurmSettings, carried, section_of
from rasterscale.workflow import reports
from rasterscale.workflow import storage as plan_storage
from rasterscale.workflow.checks import build_plan
from rasterscale.workflow.jobfiles import job_files, write_job_files
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.reuse import main_plan
from rasterscale.workflow.steps import Steps
from rasterscale.workflow.steps.base import RanksStep
from rasterscale.workflow.storage import (
    fingerprint,
    job_plan,
    load_plan,
    plan_from_json,
    plan_to_json,
    store_plan,
)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_table(path: Path, rows: list[list[str]]) -> str:
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return path.name


def table_config(workdir: Path, **predict) -> dict:
    """Three scenes from a scene table, 1 km apart (no seams between them): a (tiled, annotated, trained on), b
    (tiled), c (striped); every one predicted."""
    write_raster(workdir / "a.tif", 600, 600)
    write_raster(workdir / "b.tif", 300, 300, transform=Affine(0.1, 0, 405000.0, 0, -0.1, 3285000.0))
    write_raster(workdir / "c.tif", 300, 300, tiled=False, transform=Affine(0.1, 0, 406000.0, 0, -0.1, 3285000.0))
    (workdir / "a.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\na.tif,10,10,50,50,tree\n")
    table = write_table(
        workdir / "scenes.tsv",
        [["name", "path", "annotations"], ["a", "a.tif", "a.csv"], ["b", "b.tif", ""], ["c", "c.tif", ""]],
    )
    return {
        "scenes": table,
        "tiling": {"patch_size": 128, "overlap": 16},
        "train": {"scenes": ["a"], "validation_fraction": 0.5},
        "predict": {"scenes": "all", "devices": 2, "shards": 2, "scenes_per_job": 2, **predict},
    }


def test_the_plan_holds_the_validated_config_scenes_batches_geometry_labels_and_striped_scenes(workdir):
    warnings: list[str] = []
    plan = build_plan(table_config(workdir), warn=warnings.append)
    assert list(plan.scenes) == ["a", "b", "c"] and plan.config["predict"]["scenes"] == ["a", "b", "c"]
    assert plan.config["model"]["name"] == "detector"  # a default filled in by validation
    assert plan.run == "detector" and plan.paths == paths.RunPaths("detector")  # the run's outputs: results/detector/
    assert plan.origins == {"a": "scenes.tsv line 2", "b": "scenes.tsv line 3", "c": "scenes.tsv line 4"}
    assert [[scene.name for scene in batch.scenes] for batch in plan.batches] == [["a", "b"], ["c"]]
    assert plan.seams == () and plan.has_project()
    assert plan.geometry == {"train": Geometry("train", 1, 1), "predict": Geometry("predict", 2, 1, 2)}
    assert plan.world_size("predict") == 2 and plan.shards == 2
    assert plan.labels == ("tree",)
    assert plan.untiled == {"c": ("c.tif",)}
    assert plan.scene_raster("c") == "results/detector/c/cog.tif" and plan.scene_raster("a") == "a.tif"
    assert warnings == [
        "scene a is trained on (train.scenes) and predicted and scored (predict.scenes): "
        "results/detector/a/evaluation.json scores the model on its own training data",
        "c.tif is striped, not tiled: every windowed read would decode whole raster rows; scene c is read from the "
        "tiled COG results/detector/c/cog.tif (rule cog)",
    ]
    assert plan.evaluated_scenes() == ["a"] and plan.unbatched_scenes() == []
    assert Steps(plan).final_targets() == [  # every step's, in the order the data flows
        *(f"results/detector/batches/tiles-{batch}.json" for batch in (0, 1)),
        *(
            f"results/models/detector{file}"
            for file in (".pt", ".metrics.csv", ".png", "/config.json", "/model.safetensors")
        ),
        *(f"results/detector/batches/{step}-{batch}.json" for step in ("merge", "score") for batch in (0, 1)),
        "results/detector/project/detections.gpkg",
        "results/detector/project/detections.parquet",
        "results/detector/project/summary.tif",
        "results/detector/report/run.html",
        "results/detector/report/project_map.png",
    ]
    assert set(plan.inputs) == {"a.tif", "a.csv", "b.tif", "c.tif"} and all(plan.inputs.values())


def test_sections_are_named_by_strings(workdir):
    plan = build_plan(table_config(workdir))
    assert plan.section("predict") is plan.settings.predict
    # predict.workers unset: each of the 2 ranks is planned 2 cores (its workers then follow the cores it gets)
    assert plan.settings.predict.workers is None and plan.rank_threads("predict") == 2 * 2
    assert build_plan(table_config(workdir, workers=3)).rank_threads("predict") == 2 * (3 + 1)
    with pytest.raises(ValueError, match="no run section 'scenes'"):
        plan.section("scenes")


def test_paths_are_spelled_in_one_place():
    run = paths.RunPaths("m1")
    assert run.root == "results/m1"
    assert run.scene_dir("a") == "results/m1/a" and run.scene_dir("a+b") == "results/m1/seams/a+b"
    assert run.scene_manifest("a") == "results/m1/a/tiles.parquet"
    assert run.scene_manifest("a+b") == "results/m1/seams/a+b/tiles.parquet"
    assert run.seam_mosaic("a+b") == "results/m1/seams/a+b/mosaic.vrt"
    assert run.cog_raster("a") == "results/m1/a/cog.tif"
    assert run.scene_file("a", "classes.tif") == "results/m1/a/classes.tif"
    assert run.scene_profile("a") == "results/m1/a/predict_profile.json"
    assert run.evaluation_file("a") == "results/m1/a/evaluation.json"
    assert run.quicklook_file("a") == "results/m1/a/quicklook.png"
    assert run.project_dir() == "results/m1/project"
    assert run.project_file("detections.gpkg") == "results/m1/project/detections.gpkg"
    assert run.batches_dir() == "results/m1/batches"
    assert run.job_file("predict", 3) == "results/m1/jobs/predict/batch-3.json"
    assert run.job_file("tiles", "{batch}") == "results/m1/jobs/tiles/batch-{batch}.json"
    assert run.jobs_dir("tiles") == "results/m1/jobs/tiles"
    assert run.job_file("train") == "results/m1/jobs/train.json"
    assert run.scene_job("a") == "results/m1/jobs/tiles/scene-a.json"
    assert run.batch_record("merge", 3) == "results/m1/batches/merge-3.json"
    assert run.shard_dir(1, 2) == "results/m1/predict/batch-1/shard-2"
    assert run.shard_resume_dir(1, 2) == "results/m1/predict/batch-1/shard-2.resume"
    assert run.report_file("run.html") == "results/m1/report/run.html"
    assert run.report_scene_file("a", "counts.json") == "results/m1/report/a/counts.json"
    # rank r of shard s is rank s * world_size + r, every shard's in rank order
    assert run.rank_files("a", 1, shards=2, world_size=2) == [
        "results/m1/predict/batch-1/shard-0/a/rank-0",
        "results/m1/predict/batch-1/shard-0/a/rank-1",
        "results/m1/predict/batch-1/shard-1/a/rank-2",
        "results/m1/predict/batch-1/shard-1/a/rank-3",
    ]
    # what every run shares: not keyed by the run
    assert paths.trained_model("m") == "results/models/m.pt"
    assert paths.models_file("m.metrics.csv") == "results/models/m.metrics.csv"
    assert paths.environment_rank_file(1) == "results/checks/environment/rank-1.json"
    assert paths.check_job() == "results/checks/environment/job.json"
    assert paths.synthesis_job("resources/demo", "d") == "resources/demo/jobs/d.json"
    assert paths.stored_plan("ab12") == ".snakemake/rasterscale/plan-ab12.json"
    assert set(paths.SHARED) == {"models", "checks"}


# ---------------------------------------------------------------------------------------------------------
# A run's outputs: results/{run}/, the run named by the model
# ---------------------------------------------------------------------------------------------------------


def planned_files(plan: Plan) -> set[str]:
    """Every file and folder a plan and its jobs write: its job files (but the environment check's, which every run
    shares), its targets and the report's, each batch's records, shard folders and scenes' (and seams') tile
    manifests, rank files and merged outputs, the scoring jobs' files, the striped scenes' COGs, the project's
    layers, the trained model's files."""
    steps = Steps(plan)
    files = {*steps.final_targets(), *steps.project.outputs().values()}
    files |= set(job_files(plan)) - {paths.check_job()}
    files |= {plan.paths.job_file("project"), *(plan.scene_raster(name) for name in plan.untiled)}
    for batch in plan.batches:
        number = batch.batch
        files |= set(steps.tiles.files(number))
        files |= {step.record(number) for step in (steps.tiles, steps.merge, steps.score)}
        files |= {plan.paths.shard_dir(number, shard) for shard in range(plan.shards)}
        files |= {
            path for scene in batch.scenes for path in (scene.manifest, *scene.rank_files, *scene.outputs.values())
        }
    files |= {f.path for number in steps.score.batches() for f in steps.score.files(number)}
    if plan.train_scenes:
        files |= set(steps.train.outputs(plan.run).values())
    return files


def test_two_models_over_the_same_scenes_plan_disjoint_outputs(workdir):
    one, two = (build_plan(table_config(workdir) | {"model": {"name": name}}) for name in ("m1", "m2"))
    assert (one.run, two.run) == ("m1", "m2") and one.paths.root == "results/m1" and two.paths.root == "results/m2"
    assert [[s.name for s in b.scenes] for b in one.batches] == [[s.name for s in b.scenes] for b in two.batches]
    files = {plan.run: planned_files(plan) for plan in (one, two)}
    assert not files["m1"] & files["m2"]
    for run, planned in files.items():  # under the run's folder, but for the trained model's files (named by it too)
        outside = {path for path in planned if not path.startswith(f"results/{run}/")}
        assert outside == {path for path in planned if path.startswith(f"results/models/{run}")} != set()
    # each run forms its batches from its own recorded ones: m1's kept, m2's not taken from m1's
    assert write_job_files(one) == len(job_files(one))
    again = {
        name: build_plan(table_config(workdir, scenes_per_job=1) | {"model": {"name": name}}) for name in ("m1", "m2")
    }
    assert [[s.name for s in b.scenes] for b in again["m1"].batches] == [["a", "b"], ["c"]]
    assert [[s.name for s in b.scenes] for b in again["m2"].batches] == [["a"], ["b"], ["c"]]


def test_a_job_file_is_written_only_when_its_values_change_and_another_layout_keeps_its_time(workdir):
    plan = build_plan(table_config(workdir))
    assert write_job_files(plan) == len(job_files(plan)) and write_job_files(plan) == 0
    path = Path(plan.paths.job_file("merge", 0))
    indented = json.dumps(json.loads(path.read_text()), indent=1) + "\n"  # an earlier version's layout
    path.write_text(indented)
    os.utime(path, ns=(10**18, 10**18))
    assert write_job_files(plan) == 0  # the same values: its job does not rerun
    assert path.read_text() != indented and path.stat().st_mtime_ns == 10**18  # now in this layout, its time kept
    changed = build_plan(table_config(workdir) | {"merge": {"iou_threshold": 0.2}})
    assert write_job_files(changed) >= 1 and path.stat().st_mtime_ns != 10**18  # a value changed: rewritten


def test_a_model_file_without_a_name_names_the_run_after_its_file(workdir):
    from rasterscale.tasks.detection.model import build_detector, save_detector
    from rasterscale.tasks.detection.modelfiles import DetectorConfig

    cfg = DetectorConfig(backbone="resnet18", labels=("tree",), patch_size=128)
    (workdir / "some/dir").mkdir(parents=True)
    save_detector(build_detector(cfg), cfg, workdir / "some/dir/my-model.pt")
    config = table_config(workdir) | {"model": {"file": "some/dir/my-model.pt"}}
    config["train"] = {"scenes": []}
    plan = build_plan(config)
    assert plan.config["model"]["name"] == "my-model" and plan.run == "my-model"
    assert plan.paths == paths.RunPaths("my-model") and plan.prediction_model() == "some/dir/my-model.pt"
    planned = planned_files(plan)
    assert "results/my-model/a/detections.parquet" in planned and "results/my-model/project/detections.gpkg" in planned
    assert all(path.startswith("results/my-model/") for path in planned), sorted(planned)
    # the stem as a scene name; nothing left of it, or no file: the task's default
    named = {"x/My Model.v2.pt": "My_Model_v2", "x/_.onnx": "detector", "": "detector"}
    assert {file: validate_config({"model": {"file": file}})["model"]["name"] for file in named} == named
    assert validate_config({"task": "segmentation", "model": {"file": "x/seg.pt"}})["model"]["name"] == "seg"
    assert validate_config({"task": "segmentation"})["model"]["name"] == "segmenter"


@pytest.mark.parametrize("name", ["models", "checks"])
def test_a_model_named_as_a_folder_every_run_shares_is_refused(workdir, name):
    with pytest.raises(ConfigError) as err:
        build_plan(table_config(workdir) | {"model": {"name": name}})
    assert str(err.value) == (
        f"config: model.name '{name}' names the run's folder results/{name}/, which every run shares; name the model "
        "otherwise"
    )
    config = table_config(workdir) | {"model": {"file": f"x/{name}.pt"}, "train": {"scenes": []}}
    with pytest.raises(ConfigError) as err:  # named after its file: the line says so, before the file is looked for
        build_plan(config)
    assert str(err.value) == (
        f"config: model.name '{name}' (model.file x/{name}.pt's name: model.name is unset) names the run's folder "
        f"results/{name}/, which every run shares; name the model otherwise"
    )


# ---------------------------------------------------------------------------------------------------------
# One-line errors, as the workflow prints them
# ---------------------------------------------------------------------------------------------------------


def test_a_missing_raster_of_a_table_names_its_line(workdir):
    config = table_config(workdir)
    os.remove("b.tif")
    with pytest.raises(InputError) as err:
        build_plan(config)
    assert str(err.value) == "b.tif: raster not found (scenes.tsv line 3, column 'path')"


def test_a_header_error_of_a_table_scene_ends_with_its_line(workdir):
    config = table_config(workdir)
    write_raster(workdir / "b.tif", 300, 300, crs=None)
    with pytest.raises(InputError) as err:
        build_plan(config)
    message = str(err.value)
    assert message.startswith("b.tif: raster has no CRS") and message.endswith(" (scenes.tsv line 3)")
    assert "\n" not in message


def test_config_errors_keep_their_message_and_notices_come_first(workdir):
    warnings: list[str] = []
    config = table_config(workdir)
    config["tiling"]["overlapp"] = 1
    with pytest.raises(ConfigError) as err:
        build_plan(config, warn=warnings.append)
    assert str(err.value).startswith("config: unknown key 'tiling.overlapp'")
    config = table_config(workdir, nodes=1)  # renamed: predict.shards
    del config["predict"]["shards"]
    os.remove("a.tif")
    with pytest.raises(InputError, match=re.escape("a.tif: raster not found")):
        build_plan(config, warn=warnings.append)
    assert warnings[:1] == ["config: key 'predict.nodes' is deprecated: it is now 'predict.shards' (same meaning)"]


@pytest.mark.parametrize(
    ("section", "old", "new", "value"),
    [("model", "checkpoint", "file", "m.pt"), ("predict", "checkpoint_every", "save_every", 5)],
)
def test_a_renamed_key_is_read_under_its_new_name_with_a_notice_and_both_names_are_an_error(section, old, new, value):
    notices: list[str] = []
    config = validate_config({section: {old: value}}, notices=notices)
    assert config[section][new] == value and old not in config[section]
    assert notices == [f"config: key '{section}.{old}' is deprecated: it is now '{section}.{new}' (same meaning)"]
    with pytest.raises(
        ConfigError, match=re.escape(f"config: key '{section}.{old}' is the old name of '{section}.{new}'")
    ):
        validate_config({section: {old: value, new: value}})


def test_a_demo_scene_elsewhere_than_the_demo_folder_is_refused(workdir):
    config = {
        "scenes": {"d": {"path": "d.tif", "annotations": "d.gpkg"}},
        "demo": {"scenes": {"d": {"width": 300, "height": 300, "seed": 1}}},
        "train": {"scenes": ["d"]},
    }
    with pytest.raises(ConfigError) as err:
        build_plan(config)
    assert str(err.value) == "scenes.d: a demo scene's path must be resources/demo/d.tif"


# ---------------------------------------------------------------------------------------------------------
# Job files: written from the plan, read back by the entry scripts
# ---------------------------------------------------------------------------------------------------------


def test_a_batch_job_file_round_trips_with_every_field(workdir):
    plan = build_plan(table_config(workdir))
    batch = plan.prediction_batch(0)
    assert [scene.name for scene in batch.scenes] == ["a", "b"] and batch.batch == 0
    a = batch.scenes[0]
    assert a == Scene(
        name="a",
        raster="a.tif",
        manifest="results/detector/a/tiles.parquet",
        imagery=Imagery("scenes.a", [1, 2, 3], None),  # the default bands, filled in
        rank_files=tuple(paths.RunPaths("detector").rank_files("a", 0, 2, 2)),
        outputs={
            "gpkg": "results/detector/a/detections.gpkg",
            "parquet": "results/detector/a/detections.parquet",
            "profile": "results/detector/a/predict_profile.json",
        },
    )
    job = Steps(plan).predict.job(0)
    assert job.scenes == batch.scenes and (job.model_file, job.shards) == (plan.prediction_model(), 2)
    path = plan.paths.job_file("predict", 0)
    assert job.write(path) and PredictJob.read(path) == job
    assert PredictJob.read(path).scenes == batch.scenes
    # on disk, the outputs are flat keys of the scene's entry, as a task's merge reads them
    entry = json.loads(Path(path).read_text())["scenes"][0]
    assert entry["gpkg"] == "results/detector/a/detections.gpkg" and entry["rank_files"][0].endswith("a/rank-0")
    assert plan.prediction_batch(1).scenes[0].raster == "results/detector/c/cog.tif"
    # an unchanged job file is not written again (its job does not rerun); another kind's file is refused
    mtime = Path(path).stat().st_mtime_ns
    assert not job.write(path) and Path(path).stat().st_mtime_ns == mtime
    with pytest.raises(
        JobFileError, match=r"predict/batch-0.json: a job file of rasterscale-job/1 predict, not .* merge"
    ):
        MergeJob.read(path)


def test_each_job_file_carries_the_sections_its_job_uses_and_no_other(workdir):
    plan = build_plan(table_config(workdir))
    carried_by = {path: sorted(carried(job.settings)) for path, job in job_files(plan).items()}
    run = plan.paths
    assert carried_by[run.job_file("tiles", 0)] == ["tiling"]
    assert carried_by[run.job_file("predict", 0)] == ["model", "predict", "task", "tiling"]
    assert carried_by[run.job_file("merge", 0)] == ["merge", "predict", "task"]
    assert carried_by[run.job_file("score", 0)] == ["evaluate", "task"]
    assert carried_by[run.job_file("train")] == ["model", "scenes", "task", "tiling", "train"]
    assert carried_by[paths.check_job()] == ["dummy", "model", "predict", "scenes", "task", "tiling", "train"]
    assert len(carried_by[run.job_file("run_page")]) == len(dataclasses.fields(Settings))  # the page shows it all
    # one field, one value: the tiles and the model read tiling.patch_size from their files, both the config's
    tiles, predict = (job_files(plan)[run.job_file(kind, 0)] for kind in ("tiles", "predict"))
    assert tiles.settings.tiling == predict.settings.tiling == plan.settings.tiling
    # a prediction's and a merge's predict section lists no scene: adding a scene to another batch reruns neither
    assert (
        predict.settings.predict.scenes == ()
        and predict.settings.predict.batch_size == plan.settings.predict.batch_size
    )
    # the training's scenes section holds the training scenes' entries only
    training = job_files(plan)[run.job_file("train")]
    assert isinstance(training, TrainJob) and list(training.settings.scenes) == plan.train_scenes == ["a"]
    assert training.scenes == (
        Scene("a", "a.tif", "results/detector/a/tiles.parquet", annotations="a.csv", image_path="a.tif"),
    )
    merge = job_files(plan)[run.job_file("merge", 0)]
    assert isinstance(merge, MergeJob) and merge.labels == ("tree",) and merge.settings.merge == plan.settings.merge
    absent = r"settings.evaluate.iou_threshold: this job's file does not carry the evaluate section"
    with pytest.raises(LookupError, match=absent):
        _ = merge.settings.evaluate.iou_threshold
    with pytest.raises(LookupError, match=r"settings.scenes.a: this job's file does not carry the scenes section"):
        _ = "a" in merge.settings.scenes
    score = job_files(plan)[run.job_file("score", 0)]
    assert isinstance(score, ScoreJob) and [s.scene.name for s in score.scenes] == ["a", "b"]
    a = score.scenes[0]
    assert a.scene.outputs["parquet"] == "results/detector/a/detections.parquet" and a.scene.annotations == "a.csv"
    assert (a.evaluation, a.quicklook) == ("results/detector/a/evaluation.json", "results/detector/a/quicklook.png")
    for path, job in job_files(plan).items():  # every kind round-trips through its file
        job.write(path)
        assert type(job).read(path) == job, path


def slurm_plan(workdir: Path, **slurm) -> Plan:
    config = table_config(workdir, accelerator="gpu", shards=1)
    config["train"].update(devices=4, nodes=2, accelerator="gpu", workers=4)
    config["slurm"] = {"launcher": "srun", **slurm}
    return build_plan(config)


def test_slurm_settings_read_numbers_given_as_strings():
    given = {"launcher": "srun", "gres": "gpu", "mem_mb": "16000", "train_runtime": "60", "predict_runtime": 0}
    given |= {"gpus_per_node": 0, "partition": "", "train_stop_before_s": "120"}
    settings = section_of(SlurmSettings, given, "slurm")
    assert settings == SlurmSettings("srun", "gpu", 0, "", 16000, 60, 120, 0)
    assert settings.runtime("train") == 60 and settings.runtime("predict") == 0
    with pytest.raises(ValueError, match=r"slurm\.mem_mb: '16G' is not a whole number"):
        section_of(SlurmSettings, {**given, "mem_mb": "16G"}, "slurm")


def ranks_step(plan: Plan, section: str) -> RanksStep:
    """The DDP step of a section: training, or prediction."""
    steps = Steps(plan)
    return steps.train if section == "train" else steps.predict


def ddp_resources(plan: Plan, section: str) -> dict[str, object]:
    return ranks_step(plan, section).resources()


def launcher_prefix(plan: Plan, section: str, resources: dict[str, object], executor: str | None) -> str:
    return ranks_step(plan, section).prefix(resources, executor)


def test_ddp_resources_of_each_section(workdir):
    plan = slurm_plan(workdir, mem_mb="16000", partition="gpu", predict_runtime="30")
    assert ddp_resources(plan, "train") == {
        "nodes": 2,
        "cpus_per_task": 5,
        "mpi": "srun",
        "tasks_per_node": 4,
        "slurm_extra": "--signal=TERM@120",
        "gres": "gpu:4",
        "slurm_partition": "gpu",
        "mem_mb": 16000,
    }
    assert ddp_resources(plan, "predict") == {
        "nodes": 1,
        "cpus_per_task": 2,  # predict.workers unset: 2 cores a rank (a profile's set-resources may raise it)
        "mpi": "srun",
        "tasks_per_node": 2,
        "gres": "gpu:2",
        "slurm_partition": "gpu",
        "mem_mb": 16000,
        "runtime": 30,
    }


def test_slurm_asks_for_the_workers_set_and_a_core_per_rank(workdir):
    config = table_config(workdir, accelerator="gpu", shards=1, workers=5)
    config["slurm"] = {"launcher": "srun"}
    plan = build_plan(config)
    assert ddp_resources(plan, "predict")["cpus_per_task"] == 6 and plan.rank_threads("predict") == 2 * 6


def test_one_rank_per_node_on_several_nodes_asks_for_the_total(workdir):
    config = table_config(workdir)
    config["train"].update(devices=1, nodes=2, accelerator="gpu", workers=0)
    config["slurm"] = {"launcher": "srun", "train_stop_before_s": 0}
    resources = ddp_resources(build_plan(config), "train")
    assert resources == {
        "nodes": 2,
        "cpus_per_task": 1,
        "mpi": "srun",
        "tasks": 2,
        "slurm_extra": "--ntasks-per-node=1",
        "gres": "gpu:1",
        "tasks_per_gpu": 0,
    }
    assert launcher_prefix(build_plan(config), "train", resources, "slurm-jobstep") == srun_prefix(2, 1, 1)


def test_locally_the_gpus_alone_and_no_prefix(workdir):
    """The local launcher asks for Snakemake's gpu resource, one a rank (what an executor other than Slurm's reads,
    and a local run schedules by with --resources gpu=N), none for a section on the CPU; its job starts its own
    ranks (no prefix)."""
    config = table_config(workdir)
    config["predict"]["accelerator"] = "cpu"
    plan = build_plan(config)
    assert plan.settings.slurm.launcher == "local" and plan.section("train").accelerator == "auto"
    assert ddp_resources(plan, "train") == {"gpu": 1} and ddp_resources(plan, "predict") == {}
    assert launcher_prefix(plan, "predict", {}, None) == "" and launcher_prefix(plan, "train", {"gpu": 1}, None) == ""
    config["slurm"] = {"gres": "gpu:a100"}
    assert ddp_resources(build_plan(config), "train") == {"gpu": 1, "gpu_model": "a100"}
    config["slurm"] = {"gres": ""}  # no GPUs asked for
    assert ddp_resources(build_plan(config), "train") == {}


def test_the_launcher_prefix_checks_the_final_resources(workdir):
    plan = slurm_plan(workdir)
    resources = ddp_resources(plan, "train")
    assert launcher_prefix(plan, "train", resources, "slurm") == srun_prefix(2, 4, 5)
    with pytest.raises(PreflightError, match=re.escape("--ntasks-per-node=2 but train.devices=4")):
        launcher_prefix(plan, "train", {**resources, "tasks_per_node": 2}, "slurm")


# ---------------------------------------------------------------------------------------------------------
# The stored plan: built once by the main process, loaded by a job's re-parse
# ---------------------------------------------------------------------------------------------------------


def counting_raster_checks(monkeypatch) -> list[str]:
    """Record every raster header the plan's checks read (through the checks module's check_raster)."""
    from rasterscale.workflow import checks as plan

    read: list[str] = []
    original = plan.check_raster

    def check_raster(path):
        read.append(str(path))
        return original(path)

    monkeypatch.setattr(plan, "check_raster", check_raster)
    return read


def test_the_main_process_stores_the_plan_and_a_job_loads_it_without_reading_headers(workdir, monkeypatch):
    config = table_config(workdir)
    read = counting_raster_checks(monkeypatch)
    main = main_plan(config)
    assert set(read) == {"a.tif", "b.tif", "c.tif"}
    headers = len(read)
    stored = workdir / f".snakemake/rasterscale/plan-{fingerprint(config)}.json"
    assert stored.is_file()
    job = job_plan(config)
    assert len(read) == headers  # no header read again
    assert job == main
    assert plan_from_json(plan_to_json(main)) == main


def test_a_job_builds_the_plan_when_none_is_stored_or_it_is_stale(workdir, monkeypatch):
    config = table_config(workdir)
    read = counting_raster_checks(monkeypatch)
    warnings: list[str] = []
    assert job_plan(config, warn=warnings.append).untiled == {"c": ("c.tif",)}
    headers = len(read)
    assert set(read) == {"a.tif", "b.tif", "c.tif"} and warnings  # none stored: built, with its warnings
    assert not (workdir / ".snakemake").exists()  # a job does not store it
    main = main_plan(config)
    write_raster(workdir / "b.tif", 300, 300, tiled=False)  # changed since the main process checked it
    os.utime("b.tif", ns=(1, 1))
    assert load_plan(fingerprint(config)) is None
    rebuilt = job_plan(config)
    assert len(read) == 3 * headers and rebuilt.untiled == {"b": ("b.tif",), "c": ("c.tif",)} != main.untiled


def test_a_plan_of_another_config_or_format_or_unreadable_is_not_loaded(workdir):
    config = table_config(workdir)
    plan = build_plan(config)
    key = fingerprint(config)
    store_plan(plan, key)
    assert load_plan(key) == plan
    other = table_config(workdir, scenes_per_job=1)
    assert fingerprint(other) != key and load_plan(fingerprint(other)) is None
    path = workdir / paths.stored_plan(key)
    path.write_text(plan_to_json(plan).replace(f'"format":{plan_storage.FORMAT}', '"format":0'))
    assert load_plan(key) is None
    path.write_text(plan_to_json(plan)[:100])
    assert load_plan(key) is None


# ---------------------------------------------------------------------------------------------------------
# End-of-run reports
# ---------------------------------------------------------------------------------------------------------


def test_the_evaluation_summary_lists_the_evaluated_scenes(workdir):
    plan = build_plan(table_config(workdir))
    assert reports.evaluation_summary(plan) == []
    Path("results/detector/a").mkdir(parents=True)
    Path(plan.paths.evaluation_file("a")).write_text(
        json.dumps({"precision": 0.5, "recall": 0.25, "f1": 1 / 3, "map50": 0.2})
    )
    assert reports.evaluation_summary(plan) == [
        "rasterscale evaluation (detection):",
        f"  {'a':<20} precision=0.500 recall=0.250 f1=0.333 map50=0.200",
    ]


def test_predict_profiles_are_tables_for_few_scenes_and_lines_for_many(workdir):
    plan = build_plan(table_config(workdir))
    total = {"ranks": 2, "tiles": 9, "tiles_per_s": 4.5, "wall_s": 2.0}
    for name in "abc":
        Path(f"results/detector/{name}").mkdir(parents=True, exist_ok=True)
        Path(plan.paths.scene_profile(name)).write_text(json.dumps({"total": total}))
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(reports, "PROFILE_TABLES_UP_TO", 2)
    try:
        lines = reports.predict_profiles(plan)
    finally:
        monkeypatch.undo()
    assert lines == [
        "rasterscale predict profiles (3 scenes; tables in results/detector/{scene}/predict_profile.json):",
        *(f"  {name:<24} 2 rank(s)       9 tiles     4.50 tiles/s wall 2.0 s" for name in "abc"),
    ]


# ---------------------------------------------------------------------------------------------------------
# Torch-free
# ---------------------------------------------------------------------------------------------------------


def test_the_workflow_package_and_the_job_files_import_no_torch():
    imports = (
        "from rasterscale.workflow import plan, checks, storage, steps, reports;"
        " from rasterscale.runtime import launchers;"
        " from rasterscale.jobs import files, paths, profile, rankfiles, resume"
    )
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", imports],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "scripts")},
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "rasterscale" in imported
    assert not imported & {"torch", "lightning", "pytorch_lightning", "segmentation_models_pytorch", "torchvision"}


# ---------------------------------------------------------------------------------------------------------
# Through Snakemake: the main process stores the plan, a job's re-parse (--mode remote) loads it
# ---------------------------------------------------------------------------------------------------------


def test_a_jobs_reparse_reads_no_header_when_the_main_process_stored_the_plan(workdir):
    from workflow import workflow_command

    config = table_config(workdir)
    main = snakemake_forks.run(workflow_command(workdir, config, "-n", "--quiet"))
    assert main.returncode == 0, main.stderr[-3000:]
    assert len(list((workdir / ".snakemake/rasterscale").glob("plan-*.json"))) == 1
    assert not list((workdir / ".snakemake/rasterscale").glob("plan-*/batch-*.json"))  # a dry run runs no job
    # what the main process writes before jobs run (its onstart), as a run would
    plan_storage.store_batch_plans(build_plan(config), plan_storage.fingerprint(config))
    # b.tif's header damaged behind the plan's back: same size, same mtime; reading it would stop the parse
    stat = os.stat("b.tif")
    Path("b.tif").write_bytes(b"\0" * stat.st_size)
    os.utime("b.tif", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    job = ["--mode", "remote", "--target-jobs", "predict:batch=0,shard=0", "--cores", "1", "-n", "--quiet"]
    loaded = snakemake_forks.run(workflow_command(workdir, config, *job))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    (whole,) = (workdir / ".snakemake/rasterscale").glob("plan-*.json")
    whole.unlink()  # a job of batch 0 loads its batch's plan: the whole one is not read
    assert (whole.with_suffix("") / "batch-0.json").exists()
    loaded = snakemake_forks.run(workflow_command(workdir, config, *job))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    for stored in (workdir / ".snakemake/rasterscale").glob("plan-*"):  # the plan and its batches' plans
        shutil.rmtree(stored) if stored.is_dir() else stored.unlink()
    built = snakemake_forks.run(workflow_command(workdir, config, *job))
    assert built.returncode == 1 and "rasterscale: b.tif: " in built.stderr  # none stored: the job read it


def grid_config(workdir: Path) -> dict:
    """Nine 64 px scenes abutting in a row (8 seams), one striped, two annotated, one trained on; every one
    predicted, 2 a batch, the project's layer partitioned (more than 2 scenes)."""
    scenes = {}
    for index in range(9):
        transform = Affine(0.1, 0, 404000.0 + index * 6.4, 0, -0.1, 3285000.0)
        write_raster(workdir / f"s{index}.tif", 64, 64, transform=transform, tiled=index != 4)
        scenes[f"s{index}"] = {"path": f"s{index}.tif"}
    for name in ("s0", "s5"):
        (workdir / f"{name}.csv").write_text(f"image_path,xmin,ymin,xmax,ymax,label\n{name}.tif,1,1,9,9,tree\n")
        scenes[name]["annotations"] = f"{name}.csv"
    return {
        "scenes": scenes,
        "tiling": {"patch_size": 32, "overlap": 8},
        "train": {"scenes": ["s0"], "validation_fraction": 0.5},
        "predict": {"scenes": "all", "scenes_per_job": 2, "shards": 2},
        "project": {"partition_scenes": 2},
    }


def test_a_batch_plan_answers_what_its_batchs_jobs_ask_as_the_whole_plan_does(workdir):
    """A job of one batch loads its batch's plan (storage.plan_of_batch): every rule of the batch (tile manifests,
    prediction, merge, scoring, partition) gets the same inputs, declared files and memory from it, and its job
    files come out the same (but a partition's, which lists its neighbours' areas), while it holds a fraction of the
    scenes."""
    from rasterscale.workflow import partitions

    plan = build_plan(grid_config(workdir))
    assert partitions.partitioned(plan) and len(plan.seams) == 8 and plan.untiled and len(plan.members) == 5
    Path(plan.paths.batch_record("tiles", 0)).parent.mkdir(parents=True)
    Path(plan.paths.batch_record("tiles", 0)).write_text("{}")  # batch 0 ran, and its files are gone
    whole = Steps(plan)
    scored = whole.score.batches()
    for number in plan.batch_numbers:
        scoped_plan = plan_from_json(plan_to_json(plan_storage.plan_of_batch(plan, number)))
        scoped = Steps(scoped_plan)
        assert scoped_plan.scope == number and len(scoped_plan.scenes) < len(plan.scenes)
        for kind in ("tiles", "predict", "merge"):
            assert getattr(scoped, kind).job(number) == getattr(whole, kind).job(number)
        for name in ("tiles", "merge", "score"):
            assert getattr(scoped, name).mem_mb(number) == getattr(whole, name).mem_mb(number)
        assert scoped_plan.batch_inputs(number) == plan.batch_inputs(number)
        entries = plan.prediction_batch(number).scenes  # the batch's files, as its entries name them
        assert plan.batch_inputs(number)["manifests"] == [scene.manifest for scene in entries]
        assert plan.batch_outputs(number) == [path for scene in entries for path in scene.outputs.values()]
        for ours, theirs in ((scoped.tiles, whole.tiles), (scoped.merge, whole.merge)):
            asked = frozenset(theirs.files(number)[:1])
            assert ours.declared_files(number, asked) == theirs.declared_files(number, asked)
        assert (number == 0) == bool(scoped.tiles.declared_files(number))
        assert (number in scored) == (number in scoped.score.batches())
        if number in scored:
            assert scoped.score.job(number) == whole.score.job(number)
            assert scoped.score.inputs(number) == whole.score.inputs(number)
            assert scoped.score.declared_files(number, frozenset()) == whole.score.declared_files(number, frozenset())
        assert partitions.partitioned(scoped_plan) and scoped_plan.unbatched_scenes() == plan.unbatched_scenes() == []
        if number in partitions.partition_groups(plan):
            assert scoped.project.partition_inputs(number) == whole.project.partition_inputs(number)
            assert scoped.project.partition_mb(number) == whole.project.partition_mb(number)


@pytest.mark.parametrize(
    ("argv", "batch"),
    [
        (["--target-jobs", "merge_batch_3:", "--allowed-rules", "merge_batch_3"], 3),
        (["--target-jobs", "predict:batch=12,shard=1", "--cores", "all"], 12),
        (["--target-jobs=project_partition:batch=4"], 4),
        (["--target-jobs", "train:model=m"], None),  # of no batch: the whole plan
        (["--target-jobs", "merge_batch_3:", "score_batch_4:"], None),  # a group job of two batches
        (["--target-jobs", "merge_batch_3:", "predict:batch=3,shard=0"], 3),
        (["-n"], None),
    ],
)
def test_a_jobs_batch_is_read_from_its_target_jobs(argv, batch):
    from rasterscale.workflow.batches import job_batch

    assert job_batch(["snakemake", *argv]) == batch


def test_storing_a_plan_keeps_the_newest_stored_plans_only(workdir):
    from rasterscale.workflow.storage import KEPT_PLANS

    plan = build_plan(table_config(workdir))
    folder = workdir / ".snakemake/rasterscale"
    folder.mkdir(parents=True)
    older = [folder / f"plan-old{k:02d}.json" for k in range(KEPT_PLANS + 3)]  # old00 the oldest
    for k, path in enumerate(older):
        path.write_text(plan_to_json(plan))
        os.utime(path, (1e9 + 10 * k, 1e9 + 10 * k))
    newest = store_plan(plan, "latest")
    left = sorted(p.name for p in folder.glob("plan-*.json"))
    assert left == sorted(["plan-latest.json", *(p.name for p in older[-(KEPT_PLANS - 1) :])])
    assert load_plan("latest") is not None and newest.name == "plan-latest.json"
