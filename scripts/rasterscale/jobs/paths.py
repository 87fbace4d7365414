"""Every path the workflow's rules and jobs name, relative to the working directory: the one place each is spelled.

A run's outputs live under ``results/{run}/`` (:class:`RunPaths`), the run named by the model it predicts with
(``model.name``: :func:`rasterscale.config.schema.validate_config` names a given model file's run after the file),
so that two configs over the same scenes in one folder (two models, two tasks) keep both: a scene's files under
``results/{run}/{scene}/`` (a seam's, ``{a}+{b}``, under ``results/{run}/seams/``), the project's layers under
``results/{run}/project/``, a prediction job's under ``results/{run}/predict/batch-{b}/shard-{s}``, a batch's job
file under ``results/{run}/batches/``, the Snakemake report's renderings under ``results/{run}/report/``. What runs
share sits beside them: the models under ``results/models/``, the environment check under ``results/checks/``.
Pure string functions (no I/O): a rule may pass a wildcard pattern such as ``"{batch}"`` where a value goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rasterscale.grid.project import is_seam

RESULTS = "results"
PLAN_DIR = ".snakemake/rasterscale"  # the stored plans (rasterscale.workflow.storage)
HEADER_CACHE = f"{PLAN_DIR}/headers.sqlite"  # the plan's raster headers (rasterscale.raster.header_cache)
SHARED = ("models", "checks")  # results/ folders every run shares: no run may be named so

SCENE_PROFILE = "predict_profile.json"  # a scene's gathered prediction profile, in its folder


@dataclass(frozen=True)
class RunPaths:
    """The paths of one run's outputs, under ``results/{run}/``."""

    run: str

    @property
    def root(self) -> str:
        return f"{RESULTS}/{self.run}"

    def scene_dir(self, scene: str) -> str:
        return f"{self.root}/seams/{scene}" if is_seam(scene) else f"{self.root}/{scene}"

    def seam_mosaic(self, seam: str) -> str:
        """The VRT mosaic a seam is read from (written by its tile manifest job)."""
        return f"{self.scene_dir(seam)}/mosaic.vrt"

    def project_dir(self) -> str:
        return f"{self.root}/project"

    def project_file(self, name: str) -> str:
        """A file of the project's folder by its name (a task's project layers, the project job)."""
        return f"{self.project_dir()}/{name}"

    def batches_dir(self) -> str:
        return f"{self.root}/batches"

    def scene_manifest(self, scene: str) -> str:
        """A scene's tile manifest (GeoParquet)."""
        return f"{self.scene_dir(scene)}/tiles.parquet"

    def cog_raster(self, scene: str) -> str:
        """The tiled COG a striped scene is read from (rule cog)."""
        return f"{self.scene_dir(scene)}/cog.tif"

    def scene_file(self, scene: str, name: str) -> str:
        """A file of a scene's folder by its name (a task's merged outputs: detections.gpkg, classes.tif, ...)."""
        return f"{self.scene_dir(scene)}/{name}"

    def scene_profile(self, scene: str) -> str:
        """A scene's gathered prediction profile (written by its merge)."""
        return self.scene_file(scene, SCENE_PROFILE)

    def evaluation_file(self, scene: str) -> str:
        return self.scene_file(scene, "evaluation.json")

    def quicklook_file(self, scene: str) -> str:
        return self.scene_file(scene, "quicklook.png")

    def batch_record(self, step: str, batch: int | str) -> str:
        """The record a batch's job of the step ``step`` (its name: tiles, merge, score) writes last, listing the
        files it wrote (its tile manifests and seams' mosaics, its merged layers, its scores and report pages): what
        the jobs and targets that read them depend on, one file a batch rather than every scene's
        (:mod:`rasterscale.workflow.batches`)."""
        return f"{self.batches_dir()}/{step}-{batch}.json"

    def jobs_dir(self, kind: str) -> str:
        """The folder of a batch job's files by their kind (``tiles``: also the batches' record of their members,
        :mod:`rasterscale.workflow.batches`)."""
        return f"{self.root}/jobs/{kind}"

    def job_file(self, kind: str, batch: int | str | None = None) -> str:
        """A job's file (:mod:`rasterscale.jobs.files`) by its kind, and its batch's number for a batch's job."""
        return f"{self.root}/jobs/{kind}.json" if batch is None else f"{self.jobs_dir(kind)}/batch-{batch}.json"

    def scene_job(self, scene: str) -> str:
        """The tile manifest job's file of a scene outside every batch (a training-only scene)."""
        return f"{self.root}/jobs/tiles/scene-{scene}.json"

    def shard_dir(self, batch: int | str, shard: int | str) -> str:
        """The folder a prediction job (batch, shard) writes its ranks' files into (rule predict's output)."""
        return f"{self.root}/predict/batch-{batch}/shard-{shard}"

    def shard_resume_dir(self, batch: int | str, shard: int | str) -> str:
        """Where a prediction job's ranks save finished tiles: beside its output, which a failed job loses (not
        an output: the job removes it when it succeeds)."""
        return resume_dir(self.shard_dir(batch, shard))

    def rank_files(self, scene: str, batch: int, shards: int, world_size: int) -> list[str]:
        """A scene's rank files (paths without suffix: rasterscale.jobs.rankfiles), every shard's, in rank
        order: rank r of shard s is rank s * world_size + r."""
        return [
            rank_stem(self.shard_dir(batch, s), scene, s * world_size + r)
            for s in range(shards)
            for r in range(world_size)
        ]

    def report_file(self, name: str) -> str:
        """A file of the Snakemake report's renderings by its name (run.html, project_map.png)."""
        return f"{self.root}/report/{name}"

    def report_scene_file(self, scene: str, name: str) -> str:
        """A scene's rendering for the Snakemake report (scores.html, profile.html, profile.png, counts.json)."""
        return f"{self.root}/report/{scene}/{name}"


def rank_stem(shard_dir: str | Path, scene: str, index: int) -> str:
    """The path of a scene's rank files without suffix: ``{shard_dir}/{scene}/rank-{index}``."""
    return f"{shard_dir}/{scene}/rank-{index}"


def resume_dir(shard_dir: str | Path) -> str:
    """The folder of a prediction job's saved parts: beside its output folder, which a failed job loses."""
    return f"{str(shard_dir).rstrip('/')}.resume"


def model_dir() -> str:
    return f"{RESULTS}/models"


def models_file(name: str) -> str:
    """A file of the models' folder by its name (a task's model files: {name}.pt, {name}.metrics.csv, ...)."""
    return f"{model_dir()}/{name}"


def trained_model(name: str) -> str:
    """The model file training writes for the model ``name``."""
    return models_file(f"{name}.pt")


def demo_raster(directory: str, name: str) -> str:
    """The raster of a demo scene (rule demo) in ``demo.directory``."""
    return f"{directory}/{name}.tif"


def synthesis_job(directory: str, name: str) -> str:
    """A demo scene's synthesis job file, beside the demo's data (every run that reads the scene shares it)."""
    return f"{directory}/jobs/{name}.json"


def check_job() -> str:
    """The environment check's job file, beside its outputs."""
    return f"{RESULTS}/checks/environment/job.json"


def environment_rank_file(rank: int) -> str:
    return f"{RESULTS}/checks/environment/rank-{rank}.json"


def throughput_file() -> str:
    """The last bench results of this machine or cluster, per kind of device (written by make bench and make
    bench-gpu in the workflow's checkout; read by the dry run's cost estimate: rasterscale.workflow.throughput)."""
    return f"{RESULTS}/throughput.json"


def stored_plan(fingerprint: str) -> str:
    return f"{PLAN_DIR}/plan-{fingerprint}.json"


def stored_batch_plans(fingerprint: str) -> str:
    """The folder of a stored plan's batch plans (``batch-{b}.json``: what the jobs of batch b read)."""
    return f"{PLAN_DIR}/plan-{fingerprint}"
