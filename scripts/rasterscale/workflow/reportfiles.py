"""The Snakemake report (``snakemake --report report.zip``): its categories, the files the workflow renders for it
under ``results/{run}/report/`` (paths in :mod:`rasterscale.jobs.paths`), and what the plan hands the jobs that
render them: :class:`RunFacts` (the run's page), :class:`SceneReport` (a scene's tables and plot) and
:class:`ProjectScenes` (the project map). The rules flag these files, the quicklooks and the training curves with
Snakemake's ``report()`` (``rules/report.smk``); the renderings are :mod:`rasterscale.tools.report`'s. The jobs
(Snakemake ``script:`` entries) load the stored plan (:func:`rasterscale.workflow.storage.workflow_plan`) and take what
they need from it here: neither a command line nor the report's listing of a job's params grows with the number of
scenes. No torch, no matplotlib here: the workflow reads this module when it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rasterscale.config.settings import Settings
from rasterscale.raster.remote import local_files
from rasterscale.scene import Scene
from rasterscale.workflow.batches import recorded_targets
from rasterscale.workflow.plan import SECTIONS, Plan

# The report's categories, numbered: Snakemake's report lists categories in the order of their names.
RUN = "1. Run"
SCENES = "2. Scenes"
TRAINING = "3. Training"
PROJECT = "4. Project"

RUN_PAGE = "run.html"
PROJECT_MAP = "project_map.png"
SCENE_FILES = {"scores": "scores.html", "profile": "profile.html", "plot": "profile.png", "counts": "counts.json"}


def scene_files(plan: Plan, name: str) -> dict[str, str]:
    """A predicted scene's renderings by key: scores and prediction profile (HTML), the profile's plot (PNG), and
    its counts (JSON: what the project map reads)."""
    return {key: plan.paths.report_scene_file(name, file) for key, file in SCENE_FILES.items()}


def mapped_scenes(plan: Plan) -> list[str]:
    """The scenes the run reads (trained on or predicted), in the config's order: the project map's."""
    used = {*plan.train_scenes, *plan.predict_scenes}
    return [name for name in plan.scenes if name in used]


def report_targets(plan: Plan) -> list[str]:
    """Everything the report shows that the rest of the run does not write: the run's page, the scoring jobs'
    files (each predicted scene's evaluation, quicklook and renderings: by their batches' records,
    :func:`rasterscale.workflow.batches.recorded_targets`), the project map."""
    targets = [plan.paths.report_file(RUN_PAGE)]
    targets += recorded_targets(
        {plan.paths.batch_record("scored", b): [f.path for f in scored_files(plan, b)] for b in scored_batches(plan)}
    )
    if mapped_scenes(plan):
        targets.append(plan.paths.report_file(PROJECT_MAP))
    return targets


def model_file(plan: Plan) -> str:
    """The model file the run predicts with (trained by it, or model.file); "" when it trains none and
    predicts nothing."""
    if plan.predict_scenes or (plan.train_scenes and not plan.settings.model.file):
        return plan.prediction_model()
    return ""


# -- the run's page ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFacts:
    """What the run's page shows from the plan: the typed settings, the task and its class names, each section's
    launch geometry (``devices, nodes, world_size, shards, threads``), the model file and whether this run trains
    it, and each predicted scene's gathered profile (the precision its ranks ran at)."""

    task: str
    labels: tuple[str, ...]
    settings: Settings
    geometry: dict[str, dict[str, int]]
    model_file: str
    trained: bool
    profiles: dict[str, str]


def run_facts(plan: Plan) -> RunFacts:
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
    return RunFacts(plan.task.name, plan.labels, plan.settings, geometry, model_file(plan), trained, profiles)


def run_inputs(plan: Plan) -> dict[str, Any]:
    """Rule report_run's input: the model file (when there is one), the merge records of the batches whose
    scenes' profiles it reads."""
    model = model_file(plan)
    profiles = plan.batch_records("merged", run_facts(plan).profiles)  # the merges write the profiles
    return {**({"model": model} if model else {}), "profiles": profiles}


# -- a scene's renderings ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SceneReport:
    """A predicted scene's renderings' job: the scene (raster, merged outputs and gathered profile by key), the
    task, its class names, and the scene's evaluation file ("" when it has no annotations)."""

    scene: Scene
    task: str
    labels: tuple[str, ...]
    evaluation: str = ""


def scene_report(plan: Plan, name: str) -> SceneReport:
    evaluated = plan.is_evaluated(name)
    scene = Scene(name, plan.scene_raster(name), plan.paths.scene_manifest(name), outputs=plan.scene_outputs(name))
    evaluation = plan.paths.evaluation_file(name) if evaluated else ""
    return SceneReport(scene, plan.task.name, plan.labels, evaluation)


def scored_scenes(plan: Plan, batch: int) -> list[str]:
    """The scenes of a batch that its scoring job scores and renders: the predicted ones (not its seams, nor a
    scene the config no longer names)."""
    predicted = set(plan.predict_scenes)
    return [scene.name for scene in plan.prediction_batch(batch).scenes if scene.name in predicted]


def scored_batches(plan: Plan) -> list[int]:
    """The batches with scenes to score and render."""
    return plan.batches_of(plan.predict_scenes)


@dataclass(frozen=True)
class ScoredFile:
    """A file a batch's scoring job writes for a scene: shown in the report under the scene's name with
    ``caption`` (report/{caption}.rst) as ``item``, or not shown (``caption`` empty)."""

    path: str
    scene: str
    caption: str = ""
    item: str = ""


def scored_files(plan: Plan, batch: int) -> list[ScoredFile]:
    """A batch's scoring job's files besides its record: per scene its evaluation (with annotations), its
    quicklook and its renderings (scores and profile pages, the profile's plot, the counts)."""
    files = []
    for name in scored_scenes(plan, batch):
        pages = scene_files(plan, name)
        if plan.is_evaluated(name):
            files.append(ScoredFile(plan.paths.evaluation_file(name), name))
            files.append(ScoredFile(plan.paths.quicklook_file(name), name, "quicklook", "quicklook"))
        else:
            files.append(ScoredFile(plan.paths.quicklook_file(name), name, "quicklook_unscored", "quicklook"))
        files += [
            ScoredFile(pages["scores"], name, "scores", "scores"),
            ScoredFile(pages["profile"], name, "profile", "prediction profile"),
            ScoredFile(pages["plot"], name, "profile_plot", "prediction profile (plot)"),
            ScoredFile(pages["counts"], name),
        ]
    return files


def score_inputs(plan: Plan, batch: int) -> list[str]:
    """A batch's scoring job's inputs: its merge record (the scenes' merged outputs; their rasters come before
    them) and its scenes' annotations."""
    names = scored_scenes(plan, batch)
    evaluated = [name for name in names if plan.is_evaluated(name)]
    truth = [plan.scene_annotations(name) for name in evaluated]
    truth += local_files(plan.scene_tree_tops(name) for name in evaluated if plan.scene_tree_tops(name))
    return [plan.paths.batch_record("merged", batch), *truth]


# -- the project map --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectScenes:
    """The project map's job: each scene the run reads, with its raster (its header gives the footprint), its
    roles (``train``, ``predict``) and, for a predicted scene, the counts file its renderings' job wrote; the
    task."""

    task: str
    scenes: tuple[dict[str, Any], ...]


def project_scenes(plan: Plan) -> ProjectScenes:
    train, predict = set(plan.train_scenes), set(plan.predict_scenes)
    scenes = []
    for name in mapped_scenes(plan):
        roles = [role for role, names in (("train", train), ("predict", predict)) if name in names]
        counts = scene_files(plan, name)["counts"] if name in predict else ""
        scenes.append({"name": name, "raster": plan.scene_source(name), "roles": roles, "counts": counts})
    return ProjectScenes(plan.task.name, tuple(scenes))


def project_inputs(plan: Plan) -> dict[str, list[str]]:
    """Rule report_project_map's input: the scenes' rasters and the records of the scoring jobs that write the
    predicted scenes' counts."""
    scenes = project_scenes(plan).scenes
    rasters = plan.raster_inputs(*(s["name"] for s in scenes))  # the local ones: no URL is a file to wait for
    scored = [s["name"] for s in scenes if s["counts"]]
    return {"rasters": rasters, "counts": plan.batch_records("scored", scored)}  # the scoring jobs write the counts
