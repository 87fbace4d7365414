"""The merge step: one job a batch (rule ``merge_batch_{b}``), each scene's rank files into its layers in one
process (a merge job's start-up, its imports, costs about what merging a small scene does). It checks from the rank
records that every tile of each scene was processed exactly once before it reads any output. A dense task's merge
writes COG layers on ``cog.threads`` cores; the others' take one."""

from __future__ import annotations

from typing import Any

from rasterscale.jobs.files import MergeJob
from rasterscale.workflow import resources
from rasterscale.workflow.steps.base import RecordedStep, RuleFunction
from rasterscale.workflow.steps.predict import predict_section


class Merge(RecordedStep):
    name = MergeJob.KIND

    def inputs(self, batch: int) -> dict[str, Any]:
        """Its job file and the batch's shard folders (the rasters and manifests it reads are the prediction's
        inputs, upstream)."""
        shards = [self.plan.paths.shard_dir(batch, shard) for shard in range(self.plan.shards)]
        return {"job": self.job_file(batch), "shards": shards}

    def files(self, batch: int) -> list[str]:
        """A batch's merged files: its scenes' and seams' layers and profiles."""
        return self.plan.batch_outputs(batch)

    def threads(self) -> int:
        """``cog.threads`` where the task's merge writes COG layers (a segmentation's classes, probabilities and
        polygons side by side: rasterscale.tasks.merging.finish_layers), else one."""
        return self.plan.settings.cog.threads if self.plan.task.cog_layers else 1

    def mem_mb(self, batch: int) -> int:
        """One scene at a time: the batch's largest scene's :func:`~rasterscale.workflow.resources.merge_bytes`."""
        names = self.plan.members[batch]
        return resources.job_mb(max((resources.merge_bytes(self.plan, name) for name in names), default=0))

    def resources(self, batch: int) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb(batch))

    def job(self, batch: int) -> MergeJob:
        plan = self.plan
        settings = self.carrying("task", "merge", predict=predict_section(plan.settings.predict))
        return MergeJob(batch, plan.prediction_batch(batch).scenes, plan.labels, settings)

    def targets(self) -> list[str]:
        """The predicted scenes' batches' records and a recorded batch's files gone."""
        return self.batch_targets(self.plan.predicted_batches())
