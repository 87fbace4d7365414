"""The tiles step: each scene's tile manifest (and a seam's mosaic of its scenes' rasters, which its manifest is
cut from). A batch's job (rule ``tiles_batch_{b}``) writes its scenes' and seams' and records them; a scene no
batch holds (a training-only scene) has a job of its own (rule ``tiles``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rasterscale.jobs.files import TilesJob
from rasterscale.scene import Scene
from rasterscale.workflow import resources
from rasterscale.workflow.checks import SKIPPED
from rasterscale.workflow.steps.base import JobFiles, RecordedStep, RuleFunction


class Tiles(RecordedStep):
    name = TilesJob.KIND

    # -- a batch's rule ---------------------------------------------------------------------------------------

    def inputs(self, batch: int) -> dict[str, list[str] | str]:
        """The rasters the batch's scenes and seams read, and its job file."""
        return {"rasters": self.plan.batch_inputs(batch)["rasters"], "job": self.job_file(batch)}

    def files(self, batch: int) -> list[str]:
        """What a batch's job writes besides its record: its manifests and its seams' mosaics."""
        inputs = self.plan.batch_inputs(batch)
        return [*inputs["manifests"], *inputs["mosaics"]]

    def mem_mb(self, batch: int) -> int:
        """A batch's job, its scenes' and seams' manifests one at a time: the largest
        :func:`~rasterscale.workflow.resources.manifest_bytes`."""
        names = self.plan.members[batch]
        return resources.job_mb(max((resources.manifest_bytes(self.plan, name) for name in names), default=0))

    def resources(self, batch: int) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb(batch))

    def job(self, batch: int) -> TilesJob:
        return self.trusting(self.plan.prediction_batch(batch).scenes)

    # -- a scene outside every batch (rule tiles) -----------------------------------------------------------

    def scene_job_file(self, name: str) -> str:
        return self.plan.paths.scene_job(name)

    def scene_rasters(self, wildcards: Any) -> list[str]:
        """Input function of rule tiles: the scene's raster (none when remote: the job reads its URL)."""
        return self.plan.raster_inputs(wildcards.scene)

    def scene_mem_mb(self, name: str) -> int:
        """A scene's own job: :func:`~rasterscale.workflow.resources.manifest_bytes`."""
        return resources.job_mb(resources.manifest_bytes(self.plan, name))

    def scene_resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.scene_mem_mb(wildcards.scene))

    def scene_job(self, name: str) -> TilesJob:
        plan = self.plan
        scene = Scene(name, plan.scene_raster(name), plan.paths.scene_manifest(name), plan.scene_imagery(name))
        return self.trusting((scene,))

    def trusting(self, scenes: tuple[Scene, ...]) -> TilesJob:
        """The job of ``scenes``, with the headers the plan trusted (from STAC items) for the job to compare, and
        the folder where it records a scene whose raster is not what its item said (rasterscale.workflow.checks)."""
        plan = self.plan
        trusted = {scene.name: plan.trusted[scene.name].to_dict() for scene in scenes if scene.name in plan.trusted}
        records = plan.paths.jobs_dir(SKIPPED) if trusted else ""
        return TilesJob(scenes, self.carrying("tiling"), trusted, records)

    # -- what reads the manifests -------------------------------------------------------------------------------

    def manifest_inputs(self, names: Iterable[str]) -> list[str]:
        """What a job reading these scenes' tile manifests depends on: the manifest of a scene no batch holds
        (rule tiles), and for the others their batches' records (a batch's rule declares its record, not its
        manifests: :meth:`declared_files`)."""
        listed = list(names)
        own = [self.plan.paths.scene_manifest(name) for name in listed if not self.plan.is_predicted(name)]
        return own + self.plan.batch_records(self.name, [name for name in listed if self.plan.is_predicted(name)])

    def job_files(self) -> JobFiles:
        """The jobs of the scenes no batch holds (a batch's: :meth:`job`)."""
        for name in self.plan.unbatched_scenes():
            yield self.scene_job_file(name), self.scene_job(name)

    def targets(self) -> list[str]:
        """The predicted scenes' batches' records (a batch of seams too) and a recorded batch's files gone."""
        return self.batch_targets(self.plan.predicted_batches())
