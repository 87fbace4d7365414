"""The job files of a plan (:mod:`rasterscale.jobs.files`): which jobs it has, what each one's file holds, and where
it lies (:mod:`rasterscale.jobs.paths`). The main Snakemake process writes them all when it has built the plan
(:func:`write_job_files`), before the DAG: each is an input of its job's rule, rewritten only when its content
changes, so that a job reruns exactly when what it uses changed (and a job's re-parse writes nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rasterscale.jobs import paths
from rasterscale.jobs.files import (
    CheckJob,
    JobFile,
    MergeJob,
    PredictJob,
    ProjectJob,
    ProjectMapJob,
    RunPageJob,
    ScoredScene,
    ScoreJob,
    SummaryJob,
    SynthesisJob,
    TilesJob,
    TrainJob,
)
from rasterscale.scene import ProjectSource, Scene
from rasterscale.settings import PredictSettings, SceneSettings, Settings, sections_only
from rasterscale.workflow import partitions
from rasterscale.workflow.checks import SKIPPED
from rasterscale.workflow.plan import SECTIONS, Plan
from rasterscale.workflow.reportfiles import (
    mapped_scenes,
    predicting_model_file,
    scene_pages,
    scored_batches,
    scored_scenes,
)


def carrying(plan: Plan, *names: str, **sections: Any) -> Settings:
    """The settings of a job that uses these sections of the plan's config (``sections``: a section as the job
    gets it)."""
    return sections_only(plan.settings, *names, **sections)


def predict_section(plan: Plan) -> PredictSettings:
    """The predict section without predict.scenes (a job's file lists its scenes: adding a scene to another batch
    reruns none of this one's jobs)."""
    return dataclasses.replace(plan.settings.predict, scenes=())


def tiles_job(plan: Plan, batch: int) -> TilesJob:
    return trusting(plan, plan.prediction_batch(batch).scenes)


def scene_tiles_job(plan: Plan, name: str) -> TilesJob:
    """A training-only scene's tile manifest (rule tile_manifest)."""
    scene = Scene(name, plan.scene_raster(name), plan.paths.scene_manifest(name), plan.scene_imagery(name))
    return trusting(plan, (scene,))


def trusting(plan: Plan, scenes: tuple[Scene, ...]) -> TilesJob:
    """The tiles job of ``scenes``, with the headers the plan trusted (from STAC items) for the job to compare, and
    the folder where it records a scene whose raster is not what its item said (rasterscale.workflow.checks)."""
    trusted = {scene.name: plan.trusted[scene.name].to_dict() for scene in scenes if scene.name in plan.trusted}
    records = plan.paths.jobs_dir(SKIPPED) if trusted else ""
    return TilesJob(scenes, carrying(plan, "tiling"), trusted, records)


def predict_job(plan: Plan, batch: int) -> PredictJob:
    settings = carrying(plan, "task", "model", "tiling", predict=predict_section(plan))
    scenes = plan.prediction_batch(batch).scenes
    return PredictJob(batch, scenes, plan.prediction_model(), plan.shards, settings)


def merge_job(plan: Plan, batch: int) -> MergeJob:
    settings = carrying(plan, "task", "merge", predict=predict_section(plan))
    return MergeJob(batch, plan.prediction_batch(batch).scenes, plan.labels, settings)


def score_job(plan: Plan, batch: int) -> ScoreJob:
    scenes = []
    for name in scored_scenes(plan, batch):
        scene = plan.truth_scene(name, outputs=plan.scene_outputs(name))
        evaluation = plan.paths.evaluation_file(name) if plan.is_evaluated(name) else ""
        scenes.append(ScoredScene(scene, evaluation, plan.paths.quicklook_file(name), scene_pages(plan, name)))
    return ScoreJob(batch, tuple(scenes), plan.labels, carrying(plan, "task", "evaluate"))


def project_job(plan: Plan) -> ProjectJob:
    """What the project's merge reads: each source's layers, footprint and CRS, the seams' cores."""
    sources = tuple(partitions.source_entry(plan, name) for name in plan.project_sources())
    settings = carrying(plan, "task", "merge", "project")
    return ProjectJob(plan.project_crs(), plan.labels, sources, plan.project_outputs(), settings)


def partition_job(plan: Plan, batch: int, entries: SourceEntries | None = None) -> ProjectJob:
    """What a partition's merge reads: its batch's sources and their neighbours (their layers), their neighbours'
    areas (:mod:`rasterscale.grid.partitions`). ``entries``: the sources' entries made so far (a source is listed
    by the partitions around it: about seven)."""
    entry = entries if entries is not None else SourceEntries(plan)
    near = plan.partition_neighbourhoods[batch]
    sources = tuple(entry(name) for name in [*near.owners, *near.neighbours])
    areas = tuple(entry(name, outputs=False) for name in near.outer)
    outputs = {"partition": partitions.partition_file(plan, batch)}
    settings = carrying(plan, "task", "merge", "project")
    return ProjectJob(plan.project_crs(), plan.labels, sources, outputs, settings, near.owners, areas)


class SourceEntries:
    """Project sources' entries (:func:`rasterscale.workflow.partitions.source_entry`), each made once while the
    partitions around it are written (the last :data:`KEPT` made: partitions come batch after batch, their
    neighbours near them)."""

    KEPT = 20_000

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._made: dict[tuple[str, bool], ProjectSource] = {}

    def __call__(self, name: str, outputs: bool = True) -> ProjectSource:
        key = (name, outputs)
        if key not in self._made:
            if len(self._made) >= self.KEPT:
                self._made.clear()
            self._made[key] = partitions.source_entry(self._plan, name, outputs)
        return self._made[key]


def summary_job(plan: Plan) -> SummaryJob:
    layers = tuple(partitions.summary_layers(plan))
    settings = carrying(plan, "task", "project")
    return SummaryJob(plan.project_crs(), plan.labels, layers, partitions.summary_file(plan), settings)


def training_entries(plan: Plan) -> dict[str, SceneSettings]:
    """The training scenes' entries of ``scenes`` (their bands and normalize make the model's input), not the
    others' (adding a scene to predict changes no training)."""
    return {name: plan.scenes[name] for name in plan.train_scenes}


def train_job(plan: Plan) -> TrainJob:
    settings = carrying(plan, "task", "model", "tiling", "train", scenes=training_entries(plan))
    return TrainJob(tuple(plan.truth_scene(name) for name in plan.train_scenes), settings)


def check_job(plan: Plan) -> CheckJob:
    """The environment check's settings: its model is the config's, as training would build it without
    model.file (train.init, the training scenes' bands)."""
    settings = carrying(plan, "task", "model", "tiling", "train", "predict", "dummy", scenes=training_entries(plan))
    return CheckJob(settings)


def synthesis_job(plan: Plan, name: str) -> SynthesisJob:
    """A demo scene's synthesis: the demo section with this scene only (another config's demo scenes change
    nothing)."""
    demo = plan.settings.demo
    return SynthesisJob(name, carrying(plan, demo=dataclasses.replace(demo, scenes={name: demo.scenes[name]})))


def demo_scenes(plan: Plan) -> list[str]:
    """The demo scenes the config reads (a config without them writes nothing into demo.directory)."""
    read = {scene.path for scene in plan.scenes.values()}
    return [name for name in plan.settings.demo.scenes if plan.demo_raster(name) in read]


def run_page_job(plan: Plan) -> RunPageJob:
    geometry = {
        section: {
            "devices": plan.geometry[section].devices,
            "nodes": plan.geometry[section].nodes,
            "world_size": plan.world_size(section),
            "shards": plan.geometry[section].shards,
            "threads": plan.rank_threads(section),
        }
        for section in SECTIONS
    }
    trained = bool(plan.train_scenes) and not plan.settings.model.file
    profiles = {name: plan.paths.scene_profile(name) for name in plan.predict_scenes}
    return RunPageJob(
        plan.labels, geometry, predicting_model_file(plan), trained, profiles, plan.settings, plan.skipped
    )


def project_map_job(plan: Plan) -> ProjectMapJob:
    train, predict = set(plan.train_scenes), set(plan.predict_scenes)
    scenes = []
    for name in mapped_scenes(plan):
        roles = [role for role, names in (("train", train), ("predict", predict)) if name in names]
        counts = scene_pages(plan, name)["counts"] if name in predict else ""
        scenes.append({"name": name, "raster": plan.scene_source(name), "roles": roles, "counts": counts})
    summary = partitions.summary_file(plan) if plan.has_project() else ""
    return ProjectMapJob(tuple(scenes), carrying(plan, "task"), summary)


def job_files(plan: Plan) -> dict[str, JobFile]:
    """Every job file of the plan by its path."""
    return dict(each_job_file(plan))


def each_job_file(plan: Plan) -> Iterator[tuple[str, JobFile]]:
    """Every job file of the plan with its path, one at a time (a batch's files hold its scenes' entries: at
    200,000 scenes, all of them at once would be gigabytes)."""
    yield paths.check_job(), check_job(plan)
    run = plan.paths
    for number in plan.batch_numbers:
        yield run.job_file("tiles", number), tiles_job(plan, number)
        yield run.job_file("predict", number), predict_job(plan, number)
        yield run.job_file("merge", number), merge_job(plan, number)
    for number in scored_batches(plan):
        yield run.job_file("score", number), score_job(plan, number)
    for name in plan.unbatched_scenes():
        yield run.scene_job(name), scene_tiles_job(plan, name)
    if plan.train_scenes:
        yield run.job_file("train"), train_job(plan)
    if partitions.partitioned(plan):
        entries = SourceEntries(plan)
        for number in partitions.partition_groups(plan):
            yield run.job_file("project", number), partition_job(plan, number, entries)
    elif plan.has_project():
        yield run.job_file("project"), project_job(plan)
    if plan.has_project():
        yield run.job_file("summary"), summary_job(plan)
    for name in demo_scenes(plan):
        yield paths.synthesis_job(plan.settings.demo.directory, name), synthesis_job(plan, name)
    yield run.job_file("run_page"), run_page_job(plan)
    yield run.job_file("project_map"), project_map_job(plan)


def write_job_files(plan: Plan, workdir: str | Path = ".") -> int:
    """Write the plan's job files whose content changed (or that are missing); how many were written."""
    return sum(written for _, written in write_each_job_file(plan, workdir))


def write_each_job_file(plan: Plan, workdir: str | Path = ".") -> Iterator[tuple[str, bool]]:
    """Write each of the plan's job files whose content changed (or that is missing), one at a time: its path and
    whether it was written."""
    base = Path(workdir)
    for path, job in each_job_file(plan):
        yield path, job.write(base / path)
