"""How a DDP job's ranks start, one :class:`Launcher` a way (``slurm.launcher``): what resources a job asks its
executor for, the checks its final resources must pass and the prefix its command starts with, whether its
executor is a cluster whose jobs the dry run's cost line prices; :func:`rank_launcher` says which one started a rank.

- ``local`` (:data:`LOCAL`): the job's own process starts its node's ranks (:mod:`rasterscale.runtime.launch`), on
  whatever runs the job: this machine (``snakemake --cores``) or a node an engine gave it (a generic cluster
  executor, a Kubernetes pod, a cloud batch job: one node a job). It asks for Snakemake's own ``gpu`` resource
  (and ``gpu_model``), which executors read.
- ``srun`` (:data:`SRUN`): each rank is a Slurm task started by srun (``profiles/slurm``), on one node or many:
  the job asks for ``--nodes``, ``--ntasks-per-node``, ``--cpus-per-task`` and ``--gres``.

The workflow's DDP steps (:class:`rasterscale.workflow.steps.base.RanksStep`), the cost line
(:mod:`rasterscale.workflow.estimate`) and the ranks (:mod:`rasterscale.runtime.ranks`) ask their launcher; nothing
compares its name. Torch-free: the plan reads this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from rasterscale.runtime.cores import planned_workers
from rasterscale.runtime.preflight import (
    Geometry,
    check_gpus,
    check_local_launch,
    check_ranks,
    checked_nodes,
    checked_tasks_per_node,
    launched_by_slurm,
    srun_prefix,
    to_int,
)
from rasterscale.settings import RunSettings, SlurmSettings


class Launcher:
    """One way a DDP job's ranks start."""

    name: ClassVar[str]
    prices_cluster_jobs: ClassVar[bool] = False  # the cost line prices its jobs as a cluster's (nodes, wall time)

    def asks_gpus(self, run: RunSettings, slurm: SlurmSettings) -> bool:
        """Whether a job of this DDP section asks its executor for GPUs: ``slurm.gres`` names them (empty: none)
        and the section does not run on the CPU."""
        return bool(slurm.gres) and run.accelerator != "cpu"

    def resources(self, geometry: Geometry, run: RunSettings, slurm: SlurmSettings) -> dict[str, Any]:
        """What a job of this geometry asks its executor for, besides its threads."""
        raise NotImplementedError

    def prefix(self, geometry: Geometry, resources: Mapping[str, Any], executor: str | None, gpus_per_node: int) -> str:
        """Check a job's final resources (the rule's, the profile's defaults and overrides) and return the prefix
        its command starts its ranks with ("" = none); ``executor``: Snakemake's executor plugin, when known (not
        at plan time of a dry run), ``gpus_per_node``: what a node has (0: unknown). Raises PreflightError."""
        raise NotImplementedError


class Local(Launcher):
    """The job's own process starts its node's other ranks (rank 0 forks them: :mod:`rasterscale.runtime.launch`)."""

    name = "local"

    def resources(self, geometry: Geometry, run: RunSettings, slurm: SlurmSettings) -> dict[str, Any]:
        """Snakemake's ``gpu`` resource, one a rank (``gpu_model`` too when ``slurm.gres`` names one, e.g.
        ``gpu:a100``): a local run schedules by it when given ``--resources gpu=N``, and executors other than
        Slurm's ask their engine for it."""
        if not self.asks_gpus(run, slurm):
            return {}
        model = slurm.gres.split(":")[1] if slurm.gres.count(":") == 1 else ""
        return {"gpu": geometry.devices, **({"gpu_model": model} if model else {})}

    def prefix(self, geometry: Geometry, resources: Mapping[str, Any], executor: str | None, gpus_per_node: int) -> str:
        """None: the job starts its ranks; refused inside a Slurm job, where no srun would start them."""
        check_local_launch(geometry, self.name, executor)
        return ""


class Srun(Launcher):
    """Each rank is a Slurm task that srun starts, on one node or several."""

    name = "srun"
    prices_cluster_jobs = True

    def resources(self, geometry: Geometry, run: RunSettings, slurm: SlurmSettings) -> dict[str, Any]:
        """``devices`` tasks, and GPUs, on each node of the job.

        The executor plugin turns ``tasks_per_node`` into --ntasks-per-node only with a truthy ``mpi`` resource and
        only when > 1 (and then runs the rule's command as is: it starts with srun). One rank per node on several
        nodes asks for the total (``tasks``) and pins one per node; one rank on one node needs no ``mpi``: the
        executor runs it as one task (srun -n1).
        """
        devices, nodes = geometry.devices, geometry.nodes
        resources: dict[str, Any] = {"nodes": nodes, "cpus_per_task": planned_workers(run.workers) + 1}
        if devices > 1:
            resources.update(mpi="srun", tasks_per_node=devices)
        elif nodes > 1:
            resources.update(mpi="srun", tasks=nodes, slurm_extra="--ntasks-per-node=1")
        stop_before = slurm.train_stop_before_s if geometry.section == "train" else 0
        if stop_before:  # SIGTERM to every rank ahead of the time limit: a checkpoint, a clean stop (train/resume.py)
            resources["slurm_extra"] = " ".join(
                filter(None, [resources.get("slurm_extra"), f"--signal=TERM@{stop_before}"])
            )
        if self.asks_gpus(run, slurm):
            resources["gres"] = f"{slurm.gres}:{devices}"
            if "tasks" in resources:
                resources["tasks_per_gpu"] = 0  # or the plugin turns `tasks` into --ntasks-per-gpu
        for key, value in [
            ("slurm_partition", slurm.partition or None),
            ("mem_mb", slurm.mem_mb),
            ("runtime", slurm.runtime(geometry.section)),
        ]:
            if value:
                resources[key] = value
        return resources

    def prefix(self, geometry: Geometry, resources: Mapping[str, Any], executor: str | None, gpus_per_node: int) -> str:
        """``srun --nodes=N --ntasks-per-node=G --cpus-per-task=C --kill-on-bad-exit=1 ``, or none for a one-rank
        job (the executor's srun -n1 starts it), once the resources match the geometry."""
        nodes = checked_nodes(geometry, resources)
        tasks = to_int(resources.get("tasks"))
        per_node = checked_tasks_per_node(geometry, resources, nodes, tasks)
        check_gpus(geometry, resources, gpus_per_node)
        check_ranks(geometry, resources, tasks)
        if "mpi" not in resources:
            return ""  # one task: the executor's jobstep starts it with srun -n1
        return srun_prefix(nodes, per_node, to_int(resources.get("cpus_per_task")) or 1)


LOCAL = Local()
SRUN = Srun()
LAUNCHERS: dict[str, Launcher] = {launcher.name: launcher for launcher in (LOCAL, SRUN)}


def launcher_of(slurm: SlurmSettings) -> Launcher:
    """The launcher ``slurm.launcher`` names (the schema admits these only)."""
    return LAUNCHERS[slurm.launcher]


def rank_launcher(env: Mapping[str, str] | None = None) -> Launcher:
    """The launcher that started this process (a rank): srun where Slurm's step variables say so, else local."""
    return SRUN if launched_by_slurm(os.environ if env is None else env) else LOCAL
