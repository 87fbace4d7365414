"""The Snakemake report (``snakemake --report report.zip``): its categories, the files the workflow renders for it
under ``results/{run}/report/`` (paths in :mod:`rasterscale.jobs.paths`), and which scenes the jobs that
render them take (their job files: :mod:`rasterscale.workflow.jobfiles`). The rules flag these files, the quicklooks
and the training curves with Snakemake's ``report()`` (``rules/report.smk``); the renderings are
:mod:`rasterscale.tools.report`'s. No torch, no matplotlib here: the workflow reads this module when it loads.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from rasterscale.raster.remote import local_files
from rasterscale.workflow import partitions
from rasterscale.workflow.batches import EVERY_FILE, REPORTED_SCENES, missing_files, recorded_targets
from rasterscale.workflow.plan import Plan

# The report's categories, numbered: Snakemake's report lists categories in the order of their names.
RUN = "1. Run"
SCENES = "2. Scenes"
TRAINING = "3. Training"
PROJECT = "4. Project"

RUN_PAGE = "run.html"
PROJECT_MAP = "project_map.png"
SCENE_FILES = {"scores": "scores.html", "profile": "profile.html", "plot": "profile.png", "counts": "counts.json"}


def scene_pages(plan: Plan, name: str) -> dict[str, str]:
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


def predicting_model_file(plan: Plan) -> str:
    """The model file the run predicts with (trained by it, or model.file); "" when it trains none and
    predicts nothing."""
    if plan.predict_scenes or plan.trains:
        return plan.prediction_model()
    return ""


# -- the run's page ---------------------------------------------------------------------------------------------


def run_inputs(plan: Plan) -> dict[str, Any]:
    """Rule report_run's input: the model file (when there is one), the merge records of the batches whose
    scenes' profiles it reads."""
    model = predicting_model_file(plan)
    profiles = plan.batch_records("merged", plan.predict_scenes)  # the merges write the profiles
    return {**({"model": model} if model else {}), "profiles": profiles}


# -- a scene's renderings ---------------------------------------------------------------------------------------


def scored_scenes(plan: Plan, batch: int) -> list[str]:
    """The scenes of a batch that its scoring job scores and renders: the predicted ones (not its seams, nor a
    scene the config no longer names)."""
    return [name for name in plan.members[batch] if plan.is_predicted(name)]


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
        pages = scene_pages(plan, name)
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


def declared_scored_files(plan: Plan, batch: int, requested: AbstractSet[str]) -> list[ScoredFile]:
    """The files a batch's scoring rule declares besides its record: every one while the run predicts at most
    :data:`~rasterscale.workflow.batches.REPORTED_SCENES` scenes (the report shows each scene's pages); beyond, as
    the other batch rules (:meth:`Plan.declared_files`), those gone since the job ran and those ``requested`` (named
    on the command line), and the report shows the run and the project, not every scene. With
    :data:`~rasterscale.workflow.batches.EVERY_FILE`, every one (outputs on Snakemake's default storage)."""
    scored = scored_files(plan, batch)
    if plan.predicted_count <= REPORTED_SCENES or requested is EVERY_FILE:
        return scored
    gone = set(missing_files(plan.paths.batch_record("scored", batch), [f.path for f in scored]))
    return [f for f in scored if f.path in gone or f.path in requested]


def score_inputs(plan: Plan, batch: int) -> list[str]:
    """A batch's scoring job's inputs: its merge record (the scenes' merged outputs; their rasters come before
    them) and its scenes' annotations."""
    names = scored_scenes(plan, batch)
    evaluated = [name for name in names if plan.is_evaluated(name)]
    truth = [plan.scene_annotations(name) for name in evaluated]
    truth += local_files(plan.scene_tree_tops(name) for name in evaluated if plan.scene_tree_tops(name))
    return [plan.paths.batch_record("merged", batch), *truth]


# -- the project map --------------------------------------------------------------------------------------------


def project_inputs(plan: Plan) -> dict[str, list[str]]:
    """Rule report_project_map's input: the scenes' rasters, the records of the scoring jobs that write the
    predicted scenes' counts and the project's summary raster (a run of several scenes)."""
    scenes = mapped_scenes(plan)
    rasters = plan.raster_inputs(*scenes)  # the local ones: no URL is a file to wait for
    scored = [name for name in scenes if plan.is_predicted(name)]
    summary = [partitions.summary_file(plan)] if plan.has_project() else []
    return {"rasters": rasters, "counts": plan.batch_records("scored", scored), "summary": summary}
