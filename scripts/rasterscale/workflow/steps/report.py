"""The report step: what the Snakemake report (``snakemake --report report.zip``) shows that the rest of the run does
not write, rendered by small local jobs under ``results/{run}/report/`` (:mod:`rasterscale.tools.report` draws
them): the run's page (rule ``report_run_page``) and the project map (rule ``report_project_map``), a job file of its
own each; the report's categories; a scene's pages, which its scoring job renders
(:mod:`rasterscale.workflow.steps.score`). The rules flag these files, the quicklooks and the training curves with
Snakemake's ``report()`` (rules/common.smk's ``report_flag``). No torch, no matplotlib here: the workflow reads this
module when it loads."""

from __future__ import annotations

from typing import Any

from rasterscale.jobs.files import MergeJob, ProjectMapJob, RunPageJob, ScoreJob
from rasterscale.workflow import partitions, resources
from rasterscale.workflow.plan import SECTIONS, Plan
from rasterscale.workflow.steps.base import JobFiles, RuleFunction, Step

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


def predicting_model_file(plan: Plan) -> str:
    """The model file the run predicts with (trained by it, or model.file); "" when it trains none and predicts
    nothing."""
    if plan.predict_scenes or plan.trains:
        return plan.prediction_model()
    return ""


class Report(Step):
    name = "report"

    def page_job_file(self, page: str) -> str:
        """A page's job file, by its job's kind (RunPageJob.KIND, ProjectMapJob.KIND)."""
        return self.plan.paths.job_file(page)

    def run_page(self) -> str:
        return self.plan.paths.report_file(RUN_PAGE)

    def project_map(self) -> str:
        return self.plan.paths.report_file(PROJECT_MAP)

    def run_inputs(self, wildcards: Any = None) -> dict[str, Any]:
        """Rule report_run_page's input: the model file (when there is one), the merge records of the batches
        whose scenes' profiles it reads, its job file."""
        plan = self.plan
        model = predicting_model_file(plan)
        profiles = plan.batch_records(MergeJob.KIND, plan.predict_scenes)  # the merges write the profiles
        job = self.page_job_file(RunPageJob.KIND)
        return {**({"model": model} if model else {}), "profiles": profiles, "job": job}

    def map_inputs(self, wildcards: Any = None) -> dict[str, Any]:
        """Rule report_project_map's input: the scenes' rasters, the records of the scoring jobs that write the
        predicted scenes' counts, the project's summary raster (a run of several scenes), its job file."""
        plan = self.plan
        scenes = mapped_scenes(plan)
        scored = [name for name in scenes if plan.is_predicted(name)]
        return {
            "rasters": plan.raster_inputs(*scenes),  # the local ones: no URL is a file to wait for
            "counts": plan.batch_records(ScoreJob.KIND, scored),
            "summary": [partitions.summary_file(plan)] if plan.has_project() else [],
            "job": self.page_job_file(ProjectMapJob.KIND),
        }

    def mem_mb(self) -> int:
        """A page: the plan, the scenes' outlines, one scene's merged layer at a time for its counts, and
        matplotlib's figure."""
        plan = self.plan
        sizes = (resources.scene_size(plan, name) for name in plan.predict_scenes)
        dense = resources.is_dense(plan)
        held = max((0 if dense else resources.objects_bytes(plan, size) for size in sizes), default=0)
        return resources.job_mb(held + resources.QUICKLOOK_MB * resources.MB)

    def resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb())

    def run_page_job(self) -> RunPageJob:
        plan = self.plan
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
        profiles = {name: plan.paths.scene_profile(name) for name in plan.predict_scenes}
        model = predicting_model_file(plan)
        return RunPageJob(plan.labels, geometry, model, plan.trains, profiles, plan.settings, plan.skipped)

    def project_map_job(self) -> ProjectMapJob:
        plan = self.plan
        train, predict = set(plan.train_scenes), set(plan.predict_scenes)
        scenes = []
        for name in mapped_scenes(plan):
            roles = [role for role, names in (("train", train), ("predict", predict)) if name in names]
            counts = scene_pages(plan, name)["counts"] if name in predict else ""
            scenes.append({"name": name, "raster": plan.scene_source(name), "roles": roles, "counts": counts})
        summary = partitions.summary_file(plan) if plan.has_project() else ""
        return ProjectMapJob(tuple(scenes), self.carrying("task"), summary)

    def job_files(self) -> JobFiles:
        yield self.page_job_file(RunPageJob.KIND), self.run_page_job()
        yield self.page_job_file(ProjectMapJob.KIND), self.project_map_job()

    def targets(self) -> list[str]:
        """The run's page, and the project map when the run reads scenes (the scenes' pages are the score step's)."""
        return [self.run_page(), *([self.project_map()] if mapped_scenes(self.plan) else [])]
