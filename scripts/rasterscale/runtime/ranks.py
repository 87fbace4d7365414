"""Ranks, devices and the Lightning Trainer: what training and prediction share.

Locally (``snakemake --cores``) the job's process starts the other ranks first (:mod:`rasterscale.runtime.launch`): it
re-runs the entry command once per extra rank, so nothing in an entry may write files or assume it runs once.
Under srun (the SLURM profile) every rank is started by Slurm and Lightning's SLURM environment is used.
Either way :func:`make_trainer` runs the pre-flight checks of :mod:`rasterscale.runtime.preflight` on every rank.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy

from rasterscale.errors import InputError, one_line
from rasterscale.runtime import peers
from rasterscale.runtime import precision as precisions
from rasterscale.runtime.allocator import keep_freed_memory
from rasterscale.runtime.cores import rank_cores
from rasterscale.runtime.launchers import LOCAL, SRUN, rank_launcher
from rasterscale.runtime.lifetime import bind_rank
from rasterscale.runtime.preflight import (
    Geometry,
    PreflightError,
    check_devices_visible,
    check_launch,
    check_world_size,
    launch_geometry,
)
from rasterscale.settings import Settings

LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(message)s"
RUNTIME_LOGGER = "rasterscale.runtime"
TASKS_LOGGER = "rasterscale.tasks"  # what a task says while a rank reads its data (e.g. labels matched by case)
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")


@dataclass(frozen=True)
class RankLayout:
    """Where ranks run: accelerator, ranks per node, nodes, and numeric precision."""

    accelerator: str  # "cpu" or "gpu" (resolved, never "auto")
    devices: int
    nodes: int
    precision: precisions.PrecisionValue  # the value used (resolved, never "auto")
    section: str = "run"  # config section it comes from ("train", "predict"), named in pre-flight errors
    resolution: precisions.Resolution | None = field(default=None, repr=False)  # how, on this rank's device

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.section, self.devices, self.nodes)


def resolve_accelerator(requested: str) -> str:
    if requested == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if requested == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("accelerator 'gpu' requested but CUDA is not available on this node")
    return requested


def resolve_precision(section: str, requested: str, accelerator: str) -> precisions.Resolution:
    """The precision of this rank's ``section`` (``train``, ``predict``) on its own device
    (:mod:`rasterscale.runtime.precision`)."""
    capability = precisions.probe(accelerator, precisions.local_device_index())
    return precisions.resolve(f"{section}.precision", requested, capability)


def rank_layout(settings: Settings, name: str) -> RankLayout:
    """The run of one job of the config's ``train`` or ``predict`` section (its geometry:
    :func:`rasterscale.runtime.preflight.launch_geometry`)."""
    geometry = launch_geometry(settings, name)
    section = settings.ddp_section(name)
    accelerator = resolve_accelerator(section.accelerator)
    resolution = resolve_precision(name, section.precision, accelerator)
    return RankLayout(
        accelerator=accelerator,
        devices=geometry.devices,
        nodes=geometry.nodes,
        precision=resolution.value,
        section=name,
        resolution=resolution,
    )


def current_rank() -> int:
    """Global rank of this process as its launcher announced it (0 in the process that starts the others)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def cpu_threads_per_rank(devices: int) -> int:
    """Threads for each CPU rank: its cores (:func:`rasterscale.runtime.cores.rank_cores`: an srun task's
    --cpus-per-task, else the cores this process may use shared by its node's ranks)."""
    return rank_cores(devices)


def make_strategy(layout: RankLayout) -> Any:
    if layout.world_size == 1:
        return "auto"
    backend = "nccl" if layout.accelerator == "gpu" else "gloo"
    # Under srun, Slurm's variables define the ranks (explicitly: Lightning's own detection is off for a job
    # named bash/interactive). Snakemake, not Lightning, resubmits failed jobs: no auto-requeue.
    environment = SLURMEnvironment(auto_requeue=False) if rank_launcher() is SRUN else LightningEnvironment()
    return DDPStrategy(process_group_backend=backend, cluster_environment=environment)


def preflight_exit(error: PreflightError) -> SystemExit:
    """A pre-flight error as the one line the rank exits with (printed to stderr by Python; srun then ends the
    other ranks), also written to the rank's own log file."""
    line = f"rasterscale: {error}"
    runtime_logger = logging.getLogger(RUNTIME_LOGGER)
    record = runtime_logger.makeRecord(RUNTIME_LOGGER, logging.ERROR, __file__, 0, "%s", (line,), None)
    for handler in runtime_logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    return SystemExit(line)


def make_trainer(layout: RankLayout, **kwargs: Any) -> L.Trainer:
    """The Trainer of this rank, after the pre-flight checks of how the ranks were launched (every rank)."""
    try:
        step = check_launch(layout.geometry)
        if layout.accelerator == "gpu":
            check_devices_visible(layout.geometry, torch.cuda.device_count())
    except PreflightError as err:
        raise preflight_exit(err) from None
    callbacks = [*kwargs.pop("callbacks", []), AgreedPrecision(layout)]
    trainer = L.Trainer(
        accelerator=layout.accelerator,
        devices=layout.devices,
        num_nodes=layout.nodes,
        strategy=make_strategy(layout),
        precision=layout.precision,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )
    try:
        check_world_size(layout.geometry, trainer.world_size)
    except PreflightError as err:
        raise preflight_exit(err) from None
    log_placement(trainer, step)
    return trainer


class AgreedPrecision(L.Callback):
    """Every rank of a job uses one precision: once the ranks are connected (before the model and optimizer are
    set up for it), they share what ``auto`` resolved to on each device, and a rank whose value is not the job's
    common one (:func:`rasterscale.runtime.precision.agree`) switches to it. Explicit values are the same on every
    rank."""

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        resolution = self.layout.resolution
        if resolution is None or resolution.requested != precisions.AUTO:
            return
        values = gather_to_all(trainer, str(trainer.precision))
        agreed = precisions.agree(values)
        if agreed != str(trainer.precision):
            self.switch(trainer, agreed)
            logging.getLogger(RUNTIME_LOGGER).info(
                "precision: %s resolved to %s across the job's ranks; this rank runs %s too",
                resolution.key,
                ", ".join(values),
                agreed,
            )

    def switch(self, trainer: L.Trainer, value: precisions.PrecisionValue) -> None:
        """Run this rank at ``value`` instead of what its Trainer was made with."""
        trainer.strategy.precision_plugin = precision_plugin(value, self.layout.accelerator)


def precision_plugin(value: precisions.PrecisionValue, accelerator: str) -> Any:
    """Lightning's precision plugin for a value (what its Trainer makes of ``precision=value``)."""
    if value == precisions.FP32:
        return Precision()
    return MixedPrecision(value, "cuda" if accelerator == "gpu" else "cpu")


def log_placement(trainer: L.Trainer, step: Any = None) -> None:
    """One line per rank, in its own log: where it runs (node, Slurm job/step, local rank, device)."""
    slurm = f" slurm_job={step.job_id} step={step.step_id} node={step.node}" if step is not None else ""
    logging.getLogger(RUNTIME_LOGGER).info(
        "placement: rank %d/%d local_rank %d node_rank %d host %s%s device %s CUDA_VISIBLE_DEVICES=%s",
        trainer.global_rank,
        trainer.world_size,
        trainer.local_rank,
        trainer.node_rank,
        socket.gethostname(),
        slurm,
        trainer.strategy.root_device,
        os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
    )


def setup_rank_logging(rank: int, log_dir: str | Path | None = None, name: str = "rasterscale") -> logging.Logger:
    """Rank 0 logs progress to stderr (the rule's log); every rank also keeps its full log in its own file.

    The rank's file (``<log_dir>/rank-<rank>.log``) also gets the runtime's placement and pre-flight lines, what
    the task says while reading its data, Lightning's messages and, should the rank die of an exception, its
    traceback.
    """
    formatter = logging.Formatter(LOG_FORMAT.format(rank=rank))
    file_handler = None
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(log_dir) / f"rank-{rank}.log", mode="w")
        file_handler.setFormatter(formatter)
    loggers = []
    for logger_name in (name, RUNTIME_LOGGER, TASKS_LOGGER):
        logger = logging.getLogger(logger_name)
        logger.handlers.clear()
        logger.setLevel(logging.INFO)
        logger.propagate = False
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        console.setFormatter(formatter)
        logger.addHandler(console)
        if file_handler is not None:
            logger.addHandler(file_handler)
        loggers.append(logger)
    for logger_name in LIGHTNING_LOGGERS:  # Lightning keeps its own console output; add this rank's file
        lightning_logger = logging.getLogger(logger_name)
        for handler in [h for h in lightning_logger.handlers if getattr(h, "_rasterscale_rank_file", False)]:
            lightning_logger.removeHandler(handler)
            handler.close()
        if file_handler is not None:
            file_handler._rasterscale_rank_file = True  # type: ignore[attr-defined]
            lightning_logger.addHandler(file_handler)
    if file_handler is not None:
        peers.start(Path(file_handler.baseFilename).parent, rank)
        _log_uncaught_exceptions(loggers[0])
    return loggers[0]


def _log_uncaught_exceptions(logger: logging.Logger) -> None:
    """A rank that dies of an exception leaves its traceback in its own log file, too. An input error (a raster
    whose tile will not decode, a bad input file) is the user's to fix: the rule's log gets its one line, naming
    the file and the tile, and where the traceback is; other exceptions print their traceback there as well. A rank
    whose collective broke because a peer failed (:mod:`rasterscale.runtime.peers`) ends with one line saying so."""

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        files = [h for h in logger.handlers if isinstance(h, logging.FileHandler)]
        if not issubclass(kind, KeyboardInterrupt):
            for handler in files:
                handler.handle(
                    logger.makeRecord(
                        logger.name, logging.ERROR, __file__, 0, "rank failed", (), (kind, value, traceback)
                    )
                )
        rank = current_rank()
        if issubclass(kind, InputError) and files:
            line = f"rasterscale: rank {rank}: {one_line(value)} (traceback in {files[0].baseFilename})"
            peers.mark_failed(rank, line)
            peers.say_once(line)
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() and peers.is_peer_error(value):
            failed = peers.failed_peers(rank, wait=peers.PEER_WAIT_SECONDS)
            log_dir = Path(files[0].baseFilename).parent if files else None
            peers.say_once(peers.ending_line(rank, failed, log_dir))
            for handler in files:
                handler.flush()
            os._exit(1)  # no teardown: the process group's threads wait on the peer that is gone
        if not issubclass(kind, KeyboardInterrupt):
            peers.mark_failed(rank, f"{kind.__name__}: {value}")
        sys.__excepthook__(kind, value, traceback)

    sys.excepthook = hook


def start_rank(layout: RankLayout, log_dir: str | Path, logger_name: str) -> logging.Logger:
    """What every rank does first, in training, prediction and the environment check: its own log file (rank 0
    also logging to the rule's log), its life tied to its job's (:mod:`rasterscale.runtime.lifetime`), Lightning
    quiet on the other ranks, its freed host memory kept for its next batches (:mod:`rasterscale.runtime.allocator`),
    and on CPUs its share of the cores."""
    keep_freed_memory()
    rank = current_rank()
    logger = setup_rank_logging(rank, log_dir, name=logger_name)
    # Lightning's local launcher starts the other ranks from rank 0 unless they were started before
    # (rasterscale.runtime.launch, which sets LOCAL_RANK) or by srun
    launches_ranks = rank == 0 and layout.devices > 1 and rank_launcher() is LOCAL and "LOCAL_RANK" not in os.environ
    # a prediction rank ends at SIGTERM; training keeps its own handling (a checkpoint, then exit)
    bind_rank(launches_ranks, logging.getLogger(RUNTIME_LOGGER), sigterm_ends=layout.section == "predict")
    quiet_non_zero_ranks(rank)
    log_precision(layout, rank)
    if layout.accelerator == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(layout.devices))
    return logger


def log_precision(layout: RankLayout, rank: int) -> None:
    """Every rank logs the precision it uses and why; rank 0 also warns (one line) of a value its device emulates."""
    if layout.resolution is None:
        return
    logger = logging.getLogger(RUNTIME_LOGGER)
    logger.info("precision: %s", layout.resolution.describe())
    if layout.resolution.warning is not None and rank == 0:
        logger.warning("rasterscale: %s", layout.resolution.warning)


def attached_trainer(datamodule: L.LightningDataModule) -> L.Trainer:
    """The Trainer running ``datamodule``'s hooks: Lightning attaches it before calling any of them (a datamodule's
    ``trainer`` is optional only until then)."""
    trainer = datamodule.trainer
    assert trainer is not None, f"{type(datamodule).__name__} is not attached to a Trainer"
    return trainer


def gather_to_all(trainer: L.Trainer, item: Any) -> list[Any]:
    """Every rank's ``item`` (a small picklable object) on every rank of the job; never used for predictions."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        items: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(items, item)
        return items
    return [item]


def end_rank() -> None:
    """What every rank does last: leave the process group, so that no communication thread (gloo, NCCL) is still
    running when the interpreter exits (a C++ ``terminate called without an active exception``, exit 134, after
    every file was written)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def quiet_non_zero_ranks(rank: int) -> None:
    """Lightning's own info messages only from rank 0."""
    if rank != 0:
        for name in ("lightning", *LIGHTNING_LOGGERS, "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.WARNING)
