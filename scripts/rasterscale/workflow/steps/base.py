"""What every step of the workflow is (:class:`Step`): a plan's step under its one name, which names its rules
(``{name}``, a batch's ``{name}_batch_{b}``), its entry script (``scripts/{name}.py``), its job files
(``results/{run}/jobs/{name}...``, their kind), its batches' records (``results/{run}/batches/{name}-{b}.json``),
its logs and benchmarks (``logs/{name}/``, ``benchmarks/{name}/``). Each step's module
(:mod:`rasterscale.workflow.steps`) adds what its rules declare: inputs, outputs, resources, threads, targets, and
the job files it writes. The rules read them through one object a step; nothing here is looked up by a string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

from rasterscale.jobs.files import JobFile
from rasterscale.runtime.launchers import Launcher, launcher_of
from rasterscale.settings import Settings, sections_only
from rasterscale.workflow.batches import EVERY_FILE, batch_rule, missing_files
from rasterscale.workflow.plan import Plan

# A Snakemake rule's function of a job: it gets the job's wildcards (a namespace of the rule's wildcards by name)
RuleFunction = Callable[[Any], Any]
JobFiles = Iterator[tuple[str, JobFile]]


class Step:
    """One step of the workflow, bound to the plan its rules read."""

    name: ClassVar[str]

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    @property
    def entry(self) -> str:
        """The step's entry script, ``scripts/{entry}.py`` (rules/common.smk's ``entry_point``)."""
        return self.name

    def job_file(self, batch: int | str | None = None) -> str:
        """The step's job file (a batch's, given its number or a rule's wildcard pattern)."""
        return self.plan.paths.job_file(self.name, batch)

    def log(self, part: str) -> str:
        """A job's log, ``logs/{name}/{part}.log`` (``part``: the job's name, or a pattern of its wildcards)."""
        return f"logs/{self.name}/{part}.log"

    def log_dir(self, part: str) -> str:
        """A DDP job's folder of per-rank logs, ``logs/{name}/{part}``, beside its log."""
        return f"logs/{self.name}/{part}"

    def benchmark(self, part: str) -> str:
        """A job's Snakemake benchmark, ``benchmarks/{name}/{part}.tsv``."""
        return f"benchmarks/{self.name}/{part}.tsv"

    def carrying(self, *names: str, **sections: Any) -> Settings:
        """The settings of a job of this step that uses these sections of the plan's config (``sections``: a
        section as the job gets it): a job reruns when what it uses changes, and only then."""
        return sections_only(self.plan.settings, *names, **sections)

    def job_files(self) -> JobFiles:
        """The step's job files with their paths, one at a time (none: a step whose command line says all). A
        batch step's jobs of a prediction batch are its ``job(batch)``, which
        :meth:`rasterscale.workflow.steps.Steps.job_files` writes batch by batch."""
        return iter(())

    def targets(self) -> list[str]:
        """What the step adds to rule all's targets (the workflow's final targets are every step's)."""
        return []

    @staticmethod
    def memory(estimate: RuleFunction) -> dict[str, RuleFunction]:
        """A rule's ``resources`` from an estimate in MB, a function of the job's wildcards made with each of its
        jobs, not when the rule is parsed (a job's re-parse reads its batch's plan: the project's estimates are not
        its to make)."""
        return {"mem_mb": estimate}


class BatchStep(Step):
    """A step with one rule a batch of scenes, ``{name}_batch_{b}``, whose job writes a record last: what the jobs
    and targets that read its files depend on (:mod:`rasterscale.workflow.batches`)."""

    def rule(self, batch: int) -> str:
        return batch_rule(self.name, batch)

    def record(self, batch: int | str) -> str:
        return self.plan.paths.batch_record(self.name, batch)


class RecordedStep(BatchStep):
    """A batch step whose rule declares, of the files its job writes (:meth:`files`), only those gone since it
    wrote its record (:meth:`declared_files`)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self._gone: dict[int, list[str]] = {}  # batch -> its files gone since its record: looked for once a step

    def files(self, batch: int) -> list[str]:
        """What a batch's job writes besides its record."""
        raise NotImplementedError

    def declared_files(self, batch: int, requested: AbstractSet[str] = frozenset()) -> list[str]:
        """What a batch's rule declares besides its record: the files its job wrote that are gone since it wrote
        the record, which rule all asks for so that the job runs again
        (:func:`rasterscale.workflow.batches.missing_files`); none while they are all there, or before the job ran.
        The record stands for the rest: Snakemake's DAG spends tens of microseconds on every declared output (its
        file object, existence, mtime, the directory-output check, the dry run's listing of it), which at 200,000
        scenes would be several millions of files. Also those ``requested`` (the files named on the command line:
        :func:`rasterscale.workflow.batches.requested_files`), so that a scene's layer can be asked for by its
        path. With :data:`~rasterscale.workflow.batches.EVERY_FILE`, all of them (outputs on Snakemake's default
        storage, which takes only declared files to the bucket)."""
        if requested is EVERY_FILE:
            return self.files(batch)
        if batch not in self._gone:
            self._gone[batch] = missing_files(self.record(batch), self.files(batch))
        gone = self._gone[batch]
        if not requested:
            return gone
        return gone + [path for path in self.files(batch) if path in requested and path not in gone]

    def outputs(self, batch: int, requested: AbstractSet[str]) -> dict[str, Any]:
        """A batch rule's outputs: its record first (Snakemake finds a file's producer by trying a rule's outputs
        in order, and what reads a batch asks for its record), then the files it declares."""
        return {"record": self.record(batch), "files": self.declared_files(batch, requested)}

    def batch_targets(self, numbers: Iterable[int]) -> list[str]:
        """These batches' records, and of those recorded the files gone."""
        targets: list[str] = []
        for number in numbers:
            targets += [self.record(number), *self.declared_files(number)]
        return targets


class RanksStep(Step):
    """A step whose job runs DDP ranks (training, prediction, the environment check): the ranks of one job of its
    config ``section`` ("train" or "predict"), their cores and resources, and the prefix that starts them."""

    section: ClassVar[str]

    def world_size(self) -> int:
        """Ranks of one job (for prediction: of one shard)."""
        return self.plan.world_size(self.section)

    def threads(self) -> int:
        """The cores of a job: each device's rank and its loader workers."""
        return self.plan.rank_threads(self.section)

    @property
    def launcher(self) -> Launcher:
        """How the job's ranks start (``slurm.launcher``: :mod:`rasterscale.runtime.launchers`)."""
        return launcher_of(self.plan.settings.slurm)

    def resources(self) -> dict[str, Any]:
        """The job's resources as its launcher asks for them."""
        settings = self.plan.settings
        return self.launcher.resources(
            self.plan.geometry[self.section], self.plan.section(self.section), settings.slurm
        )

    def prefix(self, resources: dict[str, Any], executor: str | None) -> str:
        """The prefix that starts the job's ranks, after its launcher's pre-flight checks of its final resources
        (the profile's overrides included; ``executor``: Snakemake's executor plugin, when known). Raises
        PreflightError (one line)."""
        gpus_per_node = self.plan.settings.slurm.gpus_per_node
        return self.launcher.prefix(self.plan.geometry[self.section], resources, executor, gpus_per_node)
