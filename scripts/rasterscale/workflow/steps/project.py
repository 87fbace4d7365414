"""The project step: when a run predicts several scenes, every scene's and seam's merged layers into the project's
(``results/{run}/project/``), each object kept once (:mod:`rasterscale.grid.project`; rule ``project``). A task of
objects with more predicted scenes than ``project.partition_scenes`` writes a partitioned GeoParquet layer instead:
one job a batch (rule ``project_partition``), each writing its batch's sources' objects, read beside their
neighbours' (:mod:`rasterscale.grid.partitions`; which partitions, and what each depends on:
:mod:`rasterscale.workflow.partitions`)."""

from __future__ import annotations

from rasterscale.jobs.files import MergeJob, ProjectJob
from rasterscale.scene import ProjectSource
from rasterscale.workflow import partitions, resources
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.steps.base import JobFiles, RuleFunction, Step


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


class Project(Step):
    name = ProjectJob.KIND

    def partitioned(self) -> bool:
        return partitions.partitioned(self.plan)

    def outputs(self) -> dict[str, str]:
        """The project's layers (not partitioned), by the task's keys."""
        plan = self.plan
        return {key: plan.paths.project_file(file) for key, file in plan.task.project_outputs(plan.settings).items()}

    def inputs(self) -> list[str]:
        """What the project's merge depends on: the merge records of the batches holding its sources (it reads
        each source's layers, which those merges write; its job file names them)."""
        return self.plan.batch_records(MergeJob.KIND, self.plan.project_sources())

    def partition_inputs(self, batch: int) -> list[str]:
        """What a partition's job depends on: the merge records of the batches holding its sources and their
        neighbours (it reads their layers)."""
        near = self.plan.partition_neighbourhoods[batch]
        return self.plan.batch_records(MergeJob.KIND, [*near.owners, *near.neighbours])

    def partition_output(self) -> str:
        return partitions.partition_file(self.plan, "{batch}")

    def mem_mb(self) -> int:
        """Every scene's and seam's objects at once (an object is kept once across them), or a dense task's mosaic,
        vectorized block by block across its whole width (:func:`~rasterscale.workflow.resources.mosaic_width`)."""
        plan = self.plan
        if resources.is_dense(plan):
            mosaic = resources.mosaic_width(plan) * resources.DENSE_ROW_BYTES
            return resources.job_mb(mosaic + resources.DENSE_FIXED_MB * resources.MB)
        return resources.job_mb(resources.objects_of(plan, plan.project_sources()))

    def partition_mb(self, batch: int) -> int:
        """The objects of its batch's sources and of their neighbours, which it reads beside them
        (:mod:`rasterscale.grid.partitions`), not the whole project's."""
        near = self.plan.partition_neighbourhoods[batch]
        return resources.job_mb(resources.objects_of(self.plan, [*near.owners, *near.neighbours]))

    def resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb())

    def partition_resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.partition_mb(int(wildcards.batch)))

    def job(self) -> ProjectJob:
        """What the project's merge reads: each source's layers, footprint and CRS, the seams' cores."""
        plan = self.plan
        sources = tuple(partitions.source_entry(plan, name) for name in plan.project_sources())
        settings = self.carrying("task", "merge", "project")
        return ProjectJob(plan.project_crs(), plan.labels, sources, self.outputs(), settings)

    def partition_job(self, batch: int, entries: SourceEntries | None = None) -> ProjectJob:
        """What a partition's merge reads: its batch's sources and their neighbours (their layers), their
        neighbours' areas (:mod:`rasterscale.grid.partitions`). ``entries``: the sources' entries made so far (a
        source is listed by the partitions around it: about seven)."""
        plan = self.plan
        entry = entries if entries is not None else SourceEntries(plan)
        near = plan.partition_neighbourhoods[batch]
        sources = tuple(entry(name) for name in [*near.owners, *near.neighbours])
        areas = tuple(entry(name, outputs=False) for name in near.outer)
        outputs = {"partition": partitions.partition_file(plan, batch)}
        settings = self.carrying("task", "merge", "project")
        return ProjectJob(plan.project_crs(), plan.labels, sources, outputs, settings, near.owners, areas)

    def job_files(self) -> JobFiles:
        if self.partitioned():
            entries = SourceEntries(self.plan)
            for number in partitions.partition_groups(self.plan):
                yield self.job_file(number), self.partition_job(number, entries)
        elif self.plan.has_project():
            yield self.job_file(), self.job()

    def targets(self) -> list[str]:
        """The project's layers: a partitioned layer's files, else its GeoPackage and GeoParquet."""
        if not self.plan.has_project():
            return []
        if self.partitioned():
            return [partitions.partition_file(self.plan, batch) for batch in partitions.partition_groups(self.plan)]
        return list(self.outputs().values())
