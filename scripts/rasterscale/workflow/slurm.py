"""Slurm resources of the workflow's DDP jobs, and the inputs of the prefix that starts their ranks: pure functions
of the plan and the ``slurm`` settings (docs/slurm.md explains; ``rasterscale.runtime.preflight`` holds the
checks). Locally (``slurm.launcher: local``) a job has no Slurm resources and no prefix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rasterscale.runtime.cores import planned_workers
from rasterscale.runtime.preflight import plan_launch
from rasterscale.workflow.plan import Plan


def ddp_resources(plan: Plan, section: str) -> dict[str, Any]:
    """Slurm resources of a DDP job of ``section`` ("train" or "predict"; none locally): ``devices`` tasks, and
    GPUs, on each node of the job.

    The executor plugin turns ``tasks_per_node`` into --ntasks-per-node only with a truthy ``mpi`` resource and
    only when > 1 (and then runs the rule's command as is: it starts with srun). One rank per node on several
    nodes asks for the total (``tasks``) and pins one per node; one rank on one node needs no ``mpi``: the
    executor runs it as one task (srun -n1).
    """
    slurm = plan.settings.slurm
    if slurm.launcher != "srun":
        return {}
    values = plan.section(section)
    geometry = plan.geometry[section]
    devices, nodes = geometry.devices, geometry.nodes
    resources: dict[str, Any] = {"nodes": nodes, "cpus_per_task": planned_workers(values.workers) + 1}
    if devices > 1:
        resources.update(mpi="srun", tasks_per_node=devices)
    elif nodes > 1:
        resources.update(mpi="srun", tasks=nodes, slurm_extra="--ntasks-per-node=1")
    stop_before = slurm.train_stop_before_s if section == "train" else 0
    if stop_before:  # SIGTERM to every rank ahead of the time limit: a checkpoint, a clean stop (train/resume.py)
        resources["slurm_extra"] = " ".join(
            filter(None, [resources.get("slurm_extra"), f"--signal=TERM@{stop_before}"])
        )
    if slurm.gres and values.accelerator != "cpu":
        resources["gres"] = f"{slurm.gres}:{devices}"
        if "tasks" in resources:
            resources["tasks_per_gpu"] = 0  # or the plugin turns `tasks` into --ntasks-per-gpu
    for key, value in [
        ("slurm_partition", slurm.partition or None),
        ("mem_mb", slurm.mem_mb),
        ("runtime", slurm.runtime(section)),
    ]:
        if value:
            resources[key] = value
    return resources


def launcher_prefix(plan: Plan, section: str, resources: Mapping[str, Any], executor: str | None) -> str:
    """The prefix that starts a DDP job's ranks, after the pre-flight checks of its final resources (the
    profile's overrides included), which must match the config: empty locally and for a one-rank Slurm job (the
    executor's srun -n1 starts it); otherwise ``srun --nodes=N --ntasks-per-node=G --cpus-per-task=C
    --kill-on-bad-exit=1 ``. ``executor``: the Snakemake executor plugin's name, when known. Raises
    PreflightError (one line)."""
    slurm = plan.settings.slurm
    return plan_launch(plan.geometry[section], dict(resources), slurm.launcher, executor, slurm.gpus_per_node)
