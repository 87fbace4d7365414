"""Ranks, devices and the Lightning Trainer: what training and prediction share.

Locally (``snakemake --cores``) Lightning's own launcher starts the ranks: it re-runs the entry command once
per extra rank, so nothing before ``trainer.fit``/``trainer.predict`` may write files or assume it runs once.
Under srun (the SLURM profile) every rank is started by Slurm and Lightning's SLURM environment is used.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(message)s"


@dataclass(frozen=True)
class RunSpec:
    """Where ranks run: accelerator, ranks per node, nodes, and numeric precision."""

    accelerator: str  # "cpu" or "gpu" (resolved, never "auto")
    devices: int
    nodes: int
    precision: str

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes


def resolve_accelerator(requested: str) -> str:
    if requested == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if requested == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("accelerator 'gpu' requested but CUDA is not available on this node")
    return requested


def resolve_precision(precision: str, accelerator: str) -> str:
    """fp16 autocast only exists on GPUs; on CPUs the mixed-precision choice is bf16 (fast with AMX)."""
    if accelerator == "cpu" and precision == "16-mixed":
        return "bf16-mixed"
    return precision


def run_spec(section: dict[str, Any]) -> RunSpec:
    accelerator = resolve_accelerator(section["accelerator"])
    return RunSpec(
        accelerator=accelerator,
        devices=int(section["devices"]),
        nodes=int(section.get("nodes", 1)),
        precision=resolve_precision(section["precision"], accelerator),
    )


def launched_by_slurm() -> bool:
    """Ranks were started by srun (one process per task), not by Lightning."""
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ


def current_rank() -> int:
    """Global rank of this process as its launcher announced it (0 in the process that starts the others)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def cpu_threads_per_rank(devices: int, workers: int) -> int:
    """Threads for each CPU rank: the cores this process may use, shared by its node's ranks and workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, devices))


def make_strategy(spec: RunSpec) -> Any:
    if spec.world_size == 1:
        return "auto"
    backend = "nccl" if spec.accelerator == "gpu" else "gloo"
    environment = None if launched_by_slurm() else LightningEnvironment()
    return DDPStrategy(process_group_backend=backend, cluster_environment=environment)


def make_trainer(spec: RunSpec, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator=spec.accelerator,
        devices=spec.devices,
        num_nodes=spec.nodes,
        strategy=make_strategy(spec),
        precision=spec.precision,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def setup_rank_logging(rank: int, log_dir: str | Path | None = None, name: str = "rasterscale") -> logging.Logger:
    """Rank 0 logs progress to stderr (the rule's log); every rank also keeps its full log in its own file."""
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    formatter = logging.Formatter(LOG_FORMAT.format(rank=rank))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(formatter)
    logger.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(log_dir) / f"rank-{rank}.log", mode="w")
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger


def quiet_non_zero_ranks(rank: int) -> None:
    """Lightning's own info messages only from rank 0."""
    if rank != 0:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.WARNING)
