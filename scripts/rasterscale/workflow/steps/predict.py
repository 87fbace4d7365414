"""The predict step: one job a batch and shard (rule ``predict``), on one node with its world size of ranks, each
rank writing its own files (:mod:`rasterscale.jobs.rankfiles`) into the shard's folder."""

from __future__ import annotations

import dataclasses
from typing import Any

from rasterscale.jobs.files import PredictJob, TilesJob
from rasterscale.settings import PredictSettings
from rasterscale.workflow.steps.base import RanksStep


def predict_section(settings: PredictSettings) -> PredictSettings:
    """The predict section without predict.scenes (a job's file lists its scenes: adding a scene to another batch
    reruns none of this one's jobs)."""
    return dataclasses.replace(settings, scenes=())


class Predict(RanksStep):
    name = PredictJob.KIND
    section = "predict"

    def inputs(self) -> dict[str, str]:
        """The batch's tiles record (its manifests and seams' mosaics; the rasters come before them: every input
        file costs the DAG a producer lookup), its job file and the model file, as patterns of ``{batch}``."""
        return {
            "tiles": self.plan.paths.batch_record(TilesJob.KIND, "{batch}"),
            "job": self.job_file("{batch}"),
            "model": self.plan.prediction_model(),
        }

    def output(self) -> str:
        return self.plan.paths.shard_dir("{batch}", "{shard}")

    def resume_dir(self, wildcards: Any) -> str:
        """Params function: where the job's ranks save finished tiles (kept when it fails, removed when it
        succeeds: :mod:`rasterscale.jobs.resume`)."""
        return self.plan.paths.shard_resume_dir(wildcards.batch, wildcards.shard)

    def job(self, batch: int) -> PredictJob:
        plan = self.plan
        settings = self.carrying("task", "model", "tiling", predict=predict_section(plan.settings.predict))
        return PredictJob(batch, plan.prediction_batch(batch).scenes, plan.prediction_model(), plan.shards, settings)
