"""The environment check (rule ``check_environment``, not part of rule all): a prediction job's ranks on a dummy
raster, without any of the run's rasters (``snakemake --cores N check_environment``)."""

from __future__ import annotations

from rasterscale.jobs import paths
from rasterscale.jobs.files import CheckJob
from rasterscale.workflow.steps.base import JobFiles, RanksStep
from rasterscale.workflow.steps.train import training_entries


class CheckEnvironment(RanksStep):
    name = CheckJob.KIND
    section = "predict"

    def job_file(self, batch: int | str | None = None) -> str:
        """Beside its outputs, which every run shares."""
        return paths.check_job()

    def outputs(self) -> list[str]:
        return [paths.environment_rank_file(rank) for rank in range(self.world_size())]

    def job(self) -> CheckJob:
        """Its settings: its model is the config's, as training would build it without model.file (train.init,
        the training scenes' bands)."""
        sections = ("task", "model", "tiling", "train", "predict", "dummy")
        return CheckJob(self.carrying(*sections, scenes=training_entries(self.plan)))

    def job_files(self) -> JobFiles:
        yield self.job_file(), self.job()
