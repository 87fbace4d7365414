"""The cores a rank has, and what runs on them: its torch threads and its dataloader workers.

A rank's cores are an srun task's ``--cpus-per-task`` (``SLURM_CPUS_PER_TASK``; no more than the cores its
affinity allows), else the cores of the process's affinity shared by the node's ranks (``devices``). A CPU rank
runs its model on all of them (``torch.set_num_threads``: :func:`rasterscale.runtime.ranks.start_rank`).

Unless ``predict.workers`` says otherwise, its dataloader workers (:func:`auto_workers`) are:

- on a GPU rank, all its cores but one: the rank's own process keeps a core for its loop, the copies to the device
  and its outputs (blending, writing), and every other core reads ahead;
- on a CPU rank, one worker where it has more than :data:`CPU_RANK_READER_CORES` cores, else none: the model's
  threads take every core, and a tile's read (about 0.5 ms for 256 px RGB) is a small part of its forward, so one
  worker reading ahead (a remote raster's reads wait on the network) is enough. On 2 cores a worker cost more than
  the reads it took: handing a batch over costs the worker about 0.2 ms a tile beyond the read itself, and it takes
  CPU from the rank's own process (a null model's job: 291 tiles/s without a worker, 252 with one).

Each worker keeps :func:`prefetch_factor` batches queued: at least :data:`BATCHES_AHEAD` in all, so that a slow
read (remote storage) does not stall the forward the next batch is for.

OpenMP threads (torch's, oneDNN's) wait for work asleep (:func:`wait_passively`, before torch is loaded: the
package does it on import). Spinning, libgomp's default, a waiting thread keeps its core busy for a while after
every parallel region; once anything else wants that core (the rank's own dataloader worker, another rank or job)
the model's next region waits for a thread the kernel has put aside. Beside other processes, a CPU rank of 2
threads on 2 cores predicted 2.5 to 7 times slower spinning (a RetinaNet: 1.5 against 10.4 tiles/s), and stacking
a batch of tiles in the rank's process took 3 to 6 ms a tile instead of 0.55. Alone, waiting asleep cost the
forward 0 to 15% (64.5 to 72.7 ms a tile against 61.7 to 65.0).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping

from rasterscale.runtime.preflight import launched_by_slurm

BATCHES_AHEAD = 4  # the least number of batches a rank's workers keep read ahead, together
TORCH_PREFETCH_FACTOR = 2  # torch's default: batches queued by each worker
PLANNED_WORKERS = 1  # what a job's resources plan per rank for predict.workers unset: 2 cores a rank
CPU_RANK_READER_CORES = 2  # a CPU rank of more cores than this reads in one worker, else in its own process
WAIT_POLICY = "OMP_WAIT_POLICY"  # read by OpenMP (libgomp) once, when torch loads it


def wait_passively(env: MutableMapping[str, str] | None = None) -> None:
    """Let OpenMP threads wait for work asleep (``OMP_WAIT_POLICY=PASSIVE``) in this process and those it starts,
    unless the environment (``env``: this process's unless given) already says how (module docstring). Takes effect
    only before torch is first imported in the process: ``rasterscale`` calls it on import."""
    (os.environ if env is None else env).setdefault(WAIT_POLICY, "PASSIVE")


def affinity_cores() -> int:
    """Cores this process may run on (its affinity; the machine's where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def rank_cores(devices: int, env: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """The cores of one of a node's ``devices`` ranks (at least 1). Under srun: its ``--cpus-per-task``
    (``SLURM_CPUS_PER_TASK``), no more than its affinity (Slurm may or may not bind a task to its cores); else the
    affinity's ``cores`` shared by the node's ranks. ``env`` and ``cores``: this process's unless given."""
    env = os.environ if env is None else env
    cores = affinity_cores() if cores is None else cores
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if launched_by_slurm(env) and per_task.isdigit() and int(per_task) > 0:
        return max(1, min(int(per_task), cores))
    return max(1, cores // max(1, devices))


def auto_workers(cores: int, accelerator: str) -> int:
    """Dataloader workers of a rank of ``cores`` cores when ``predict.workers`` is unset (module docstring): a GPU
    rank's cores but one; on a CPU rank one beyond :data:`CPU_RANK_READER_CORES` cores, else none."""
    if accelerator == "gpu":
        return max(0, cores - 1)
    return 1 if cores > CPU_RANK_READER_CORES else 0


def rank_workers(configured: int | None, accelerator: str, devices: int) -> int:
    """A rank's dataloader workers: ``predict.workers`` where the config sets it, else :func:`auto_workers` of
    the rank's cores (:func:`rank_cores`)."""
    if configured is not None:
        return configured
    return auto_workers(rank_cores(devices), accelerator)


def planned_workers(configured: int | None) -> int:
    """The workers per rank a DDP job's resources are planned for (Slurm's ``cpus_per_task``, Snakemake's
    ``threads``: workers + 1 per rank): ``predict.workers`` where set, else :data:`PLANNED_WORKERS`. A rank with
    ``predict.workers`` unset then takes the workers of the cores it gets (a profile's ``set-resources`` may raise
    ``cpus_per_task``)."""
    return PLANNED_WORKERS if configured is None else configured


def prefetch_factor(workers: int) -> int | None:
    """Batches each of ``workers`` dataloader workers keeps queued (DataLoader's ``prefetch_factor``): torch's 2,
    more with few workers so that :data:`BATCHES_AHEAD` are queued in all; None without workers (DataLoader then
    takes none)."""
    if workers <= 0:
        return None
    return max(TORCH_PREFETCH_FACTOR, math.ceil(BATCHES_AHEAD / workers))
