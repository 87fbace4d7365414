"""Pre-flight checks of how DDP ranks are launched: at plan time (``snakemake -n``) and again in every rank.

Each check turns a known way to waste a GPU allocation into a one-line error that names the fix:

- **ntasks-per-node ≠ devices**: Slurm starts one task per rank; Lightning expects ``devices`` ranks per node.
  Too few tasks hang or run N times slower, too many repeat the work.
- **nodes ≠ num_nodes**: the job's (or srun step's) node count must be the DDP world's ``nodes``.
- **ranks > 1 without srun**: inside a Slurm job only srun starts the other ranks (Lightning waits for them).
- **world size other than asked**: inside a one-task step (``srun -n1``, what the executor does for a rule
  without the ``mpi`` resource) Lightning silently trains on one rank; the world size is checked on every rank.

Plan-time checks look at the job's resources (after the profile's overrides), asked by its launcher
(:mod:`rasterscale.runtime.launchers`), which returns the prefix the rule runs with; in-process checks look at the
variables srun sets (``SLURM_STEP_*``) and at the Trainer.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rasterscale.settings import Settings

# The executor plugin submits with "slurm"; inside the job, Snakemake runs the rule with "slurm-jobstep".
SLURM_EXECUTORS = frozenset({"slurm", "slurm-jobstep"})
PROFILE_HINT = "--profile profiles/slurm (it sets slurm.launcher: srun)"


class PreflightError(RuntimeError):
    """A launch that would hang, silently shrink the world or repeat the work; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(f"preflight: {message}")


@dataclass(frozen=True)
class Geometry:
    """The launch geometry of a config section: ``devices`` ranks on each of ``nodes`` nodes in one job, and
    ``shards`` such jobs (prediction; training is one job). The one place these figures are computed
    (:func:`launch_geometry`): the workflow's resources and launchers, the ranks' run spec and the pre-flight
    checks all read them from here."""

    section: str  # config section: "train" or "predict"
    devices: int
    nodes: int
    shards: int = 1

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    def describe(self) -> str:
        nodes = "1 node" if self.nodes == 1 else f"{self.nodes} nodes"
        return f"{self.section}.devices={self.devices} x {nodes}"

    def srun_hint(self) -> str:
        return f"srun --nodes={self.nodes} --ntasks-per-node={self.devices}"


def launch_geometry(settings: Settings, section: str) -> Geometry:
    """The geometry of a validated config's ``train`` or ``predict`` section.

    Training spans ``train.nodes`` nodes (multi-node DDP, Lightning's num_nodes) in one job. Prediction runs
    ``predict.shards`` jobs, each on one node: a shard's tiles never need another node's ranks.
    """
    if section == "train":
        train = settings.train
        return Geometry(section, train.devices, train.nodes)
    if section == "predict":
        predict = settings.predict
        return Geometry(section, predict.devices, 1, predict.shards)
    raise ValueError(f"no run section '{section}' (train or predict)")


def srun_prefix(nodes: int, tasks_per_node: int, cpus_per_task: int) -> str:
    """The command prefix that starts one Slurm task per rank (inside the job's allocation).

    Every geometry option is explicit: the executor's jobstep strips the job's SLURM_* variables, and srun
    since Slurm 22.05 does not inherit --cpus-per-task. --kill-on-bad-exit ends every rank as soon as one fails.
    """
    options = [f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}", f"--cpus-per-task={cpus_per_task}"]
    return " ".join(["srun", *options, "--kill-on-bad-exit=1", ""])


def to_int(value: Any) -> int | None:
    """A resource's value as an int (None when it is not one)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _option(extra: Any, name: str) -> int | None:
    """The integer value of ``--name=N`` (or ``--name N``) in a slurm_extra string."""
    match = re.search(rf"--{name}[=\s]+(\d+)", str(extra or ""))
    return int(match.group(1)) if match else None


def _gres_count(gres: Any) -> int | None:
    """The count of a GRES request such as ``gpu:4`` or ``gpu:a100:4`` (None without a count)."""
    match = re.fullmatch(r"[^:]+(?::[^:]+)?:(\d+)[TGM]?", str(gres or ""))
    return int(match.group(1)) if match else None


def check_local_launch(geometry: Geometry, launcher: str, executor: str | None) -> None:
    """A ``launcher`` that starts the ranks in the job's process starts no Slurm task: a Slurm job of several
    ranks would hang or shrink."""
    g = geometry
    if executor in SLURM_EXECUTORS and g.world_size > 1:
        raise PreflightError(
            f"{g.section}: {g.world_size} ranks ({g.describe()}) in a Slurm job, but slurm.launcher is '{launcher}' "
            "so no srun would start them (Lightning would hang or silently run world size 1): run with "
            f"{PROFILE_HINT}"
        )


def checked_nodes(geometry: Geometry, resources: Mapping[str, Any]) -> int:
    """The nodes the job asks Slurm for, which must be the geometry's (a prediction shard's: 1)."""
    g, s = geometry, geometry.section
    nodes = to_int(resources.get("nodes")) or 1
    if nodes != g.nodes:
        if s == "predict":
            raise PreflightError(
                f"predict: a prediction shard job asks Slurm for --nodes={nodes} but each shard runs on 1 node: "
                "remove the nodes override from the profile and set predict.shards (the number of shard jobs)"
            )
        raise PreflightError(
            f"{s}: the job asks Slurm for --nodes={nodes} but {s}.nodes={g.nodes} (Lightning's num_nodes): "
            f"set {s}.nodes: {nodes} or remove the nodes override from the profile"
        )
    return nodes


def checked_tasks_per_node(geometry: Geometry, resources: Mapping[str, Any], nodes: int, tasks: int | None) -> int:
    """The tasks per node the job asks Slurm for (``tasks_per_node``, ``--ntasks-per-node``, ``tasks`` over the
    nodes, else 1), which must be the geometry's devices: one task per device."""
    g, s = geometry, geometry.section
    per_node = (
        to_int(resources.get("tasks_per_node"))
        or _option(resources.get("slurm_extra"), "ntasks-per-node")
        or (tasks // nodes if tasks else None)
        or 1
    )
    if per_node != g.devices:
        raise PreflightError(
            f"{s}: the job asks Slurm for --ntasks-per-node={per_node} but {s}.devices={g.devices} "
            f"(one task per device): set {s}.devices: {per_node} or remove the tasks_per_node/--ntasks-per-node "
            "override from the profile"
        )
    return per_node


def check_gpus(geometry: Geometry, resources: Mapping[str, Any], gpus_per_node: int) -> None:
    """The GPUs per node the job asks Slurm for (its gres, when it counts them) must be the geometry's devices,
    and a node must have as many (``gpus_per_node``, 0: unknown)."""
    g, s = geometry, geometry.section
    gpus = _gres_count(resources.get("gres"))
    if gpus is not None and gpus != g.devices:
        raise PreflightError(
            f"{s}: the job asks Slurm for {gpus} GPUs per node (gres={resources.get('gres')}) but "
            f"{s}.devices={g.devices} (one GPU per rank): set {s}.devices: {gpus} or remove the gres override "
            "from the profile"
        )
    if gpus is not None and gpus_per_node and g.devices > gpus_per_node:
        raise PreflightError(
            f"{s}: {s}.devices={g.devices} but a node has {gpus_per_node} GPUs (slurm.gpus_per_node), so the "
            f"job would never start: set {s}.devices: {gpus_per_node} or fewer (and {s}.nodes for more nodes)"
        )


def check_ranks(geometry: Geometry, resources: Mapping[str, Any], tasks: int | None) -> None:
    """Several ranks need the ``mpi`` resource (else the executor starts one task), and the job's ``tasks``, when
    given, must be the world size."""
    g, s = geometry, geometry.section
    if g.world_size > 1 and "mpi" not in resources:
        raise PreflightError(
            f"{s}: {g.world_size} ranks asked for ({g.describe()}) but the job has no `mpi` resource, so the "
            "executor would run it as one task (srun -n1) and Lightning would silently run world size 1: "
            f"give the rule mpi=srun and tasks_per_node, or run with {PROFILE_HINT}"
        )
    if tasks is not None and tasks != g.world_size:
        raise PreflightError(
            f"{s}: the job asks Slurm for --ntasks={tasks} but {g.world_size} ranks were asked for "
            f"({g.describe()}): remove the tasks override from the profile"
        )


# ---------------------------------------------------------------------------------------------------------
# In the launched process
# ---------------------------------------------------------------------------------------------------------


def parse_tasks_per_node(value: str) -> list[int]:
    """Slurm's compact tasks-per-node list, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"unreadable tasks-per-node list {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass(frozen=True)
class SlurmStep:
    """The srun step this process is a task of, as its environment tells."""

    job_id: str
    step_id: str
    ntasks: int
    nnodes: int
    tasks_per_node: tuple[int, ...]
    procid: int
    node: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmStep | None:
        if not launched_by_slurm(env):
            return None
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        listed = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        per_node = tuple(parse_tasks_per_node(listed)) if listed else (ntasks // max(1, nnodes),) * nnodes
        return cls(
            job_id=slurm_job_id(env) or "?",
            step_id=env["SLURM_STEP_ID"],
            ntasks=ntasks,
            nnodes=nnodes,
            tasks_per_node=per_node,
            procid=int(env["SLURM_PROCID"]),
            node=env.get("SLURMD_NODENAME", ""),
        )


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The Slurm job this process runs in (None outside any allocation)."""
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")


def launched_by_slurm(env: Mapping[str, str] | None = None) -> bool:
    """This process is a task of an srun step (srun started the ranks, one process per task)."""
    env = os.environ if env is None else env
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def check_launch(geometry: Geometry, env: Mapping[str, str] | None = None) -> SlurmStep | None:
    """Before the Trainer exists: does the way this process was started match the geometry asked for?

    Outside a Slurm job nothing is checked (Lightning starts the ranks itself). Inside one, the ranks must be
    the tasks of an srun step with ``nodes`` nodes and ``devices`` tasks on each. Returns the step, if any.
    """
    env = os.environ if env is None else env
    g = geometry
    s = g.section
    job_id = slurm_job_id(env)
    if job_id is None:
        return None
    step = SlurmStep.from_env(env)
    if step is None:
        if g.world_size > 1:
            raise PreflightError(
                f"{s}: {g.world_size} ranks ({g.describe()}) asked for inside Slurm job {job_id}, but this "
                f"process was not started by srun, so Lightning would wait for ranks nobody starts (or crowd "
                f"them onto one task's CPUs): launch it with `{g.srun_hint()} ...` or run with {PROFILE_HINT}"
            )
        return None
    if step.ntasks == 1 and g.world_size > 1:
        raise PreflightError(
            f"{s}: this process is the only task of Slurm step {job_id}.{step.step_id} but {g.world_size} "
            f"ranks were asked for ({g.describe()}), and Lightning would silently run world size 1: launch it "
            f"with `{g.srun_hint()} ...` (the workflow's rules: run with {PROFILE_HINT})"
        )
    if step.nnodes != g.nodes:
        if s == "predict":
            fix = "launch each prediction shard with srun --nodes=1 (predict.shards counts shard jobs)"
        else:
            fix = f"set {s}.nodes: {step.nnodes} or launch with srun --nodes={g.nodes}"
        raise PreflightError(
            f"{s}: this srun step spans {step.nnodes} nodes but the DDP world has {g.nodes} "
            f"({g.describe()}, Lightning's num_nodes): {fix}"
        )
    wrong = sorted({n for n in step.tasks_per_node if n != g.devices})
    if wrong:
        raise PreflightError(
            f"{s}: Slurm started {wrong[0]} tasks per node (--ntasks-per-node={wrong[0]}) but "
            f"{s}.devices={g.devices} (one task per device): set {s}.devices: {wrong[0]} or launch with "
            f"srun --ntasks-per-node={g.devices}"
        )
    if step.ntasks != g.world_size:
        raise PreflightError(
            f"{s}: the srun step has {step.ntasks} tasks but {g.world_size} ranks were asked for "
            f"({g.describe()}): launch it with `{g.srun_hint()} ...`"
        )
    return step


def check_world_size(geometry: Geometry, world_size: int) -> None:
    """After the Trainer exists (on every rank): is Lightning's world the one asked for?"""
    g = geometry
    if world_size != g.world_size:
        raise PreflightError(
            f"{g.section}: Lightning runs world size {world_size} but {g.world_size} ranks were asked for "
            f"({g.describe()}): under Slurm launch the ranks with `{g.srun_hint()} ...` ({PROFILE_HINT}); "
            "locally, leave SLURM_*/torchrun variables out of the environment"
        )


def check_devices_visible(geometry: Geometry, visible: int, env: Mapping[str, str] | None = None) -> None:
    """GPU ranks: every local rank needs its own visible GPU (cuda:local_rank)."""
    env = os.environ if env is None else env
    g = geometry
    if visible < g.devices:
        shown = env.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise PreflightError(
            f"{g.section}: {g.section}.devices={g.devices} GPU ranks per node but this process sees {visible} "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={shown}): set {g.section}.devices: {visible}, or give the job "
            f"{g.devices} GPUs per node without binding GPUs to tasks (no --gpus-per-task/--gpu-bind)"
        )
