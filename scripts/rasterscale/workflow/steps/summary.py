"""The summary step: the project's summary raster (rule ``summary``, :mod:`rasterscale.raster.summary`), a COG of
``project.summary_cell``: objects per hectare (or class cover, or mean value), read from the project's layer
without loading it whole; the report's project map."""

from __future__ import annotations

from rasterscale.jobs.files import SummaryJob
from rasterscale.workflow import partitions
from rasterscale.workflow.steps.base import JobFiles, RuleFunction, Step
from rasterscale.workflow.steps.project import Project


class Summary(Step):
    name = SummaryJob.KIND

    def inputs(self) -> list[str]:
        """The project's layer it reads (:func:`rasterscale.workflow.partitions.summary_layers`)."""
        return partitions.summary_layers(self.plan)

    def output(self) -> str:
        return partitions.summary_file(self.plan)

    def mem_mb(self) -> int:
        """The project's layers' estimate (:meth:`Project.mem_mb`): it reads them a block at a time, but the
        project's merge before it held them."""
        return Project(self.plan).mem_mb()

    def resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb())

    def job(self) -> SummaryJob:
        plan = self.plan
        settings = self.carrying("task", "project")
        return SummaryJob(plan.project_crs(), plan.labels, tuple(self.inputs()), self.output(), settings)

    def job_files(self) -> JobFiles:
        if self.plan.has_project():
            yield self.job_file(), self.job()

    def targets(self) -> list[str]:
        return [self.output()] if self.plan.has_project() else []
