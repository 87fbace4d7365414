"""DDP training of a task's model with Lightning (the task makes the model, the samples and the scores).

Batch semantics are explicit: ``train.batch_size`` is the effective global batch, each rank loads
``ceil(batch_size / world_size)`` tiles, and the learning rate follows the effective batch when
``lr_scaling: linear``. The batch sizes are logged once, by rank 0, before the first step. Only rank 0 logs progress,
validates (on tiles of a held-out band of each training scene) and writes the model file, the training curves
(CSV) and their plot. Resume checkpoints, and the stop on SIGTERM: :mod:`rasterscale.train.resume`.
"""

from __future__ import annotations

import csv
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from rasterscale.atomic import save_figure
from rasterscale.datasets.sampling import EpochSampler, FlippableSamples, KeyedSamples
from rasterscale.errors import InputError
from rasterscale.grid.manifest import read_manifest, tiles_from_frame
from rasterscale.grid.split import split_train_validation
from rasterscale.raster.bands import InputBands, pooled_statistics
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import read_spec
from rasterscale.runtime.batching import BatchSizes, batch_sizes
from rasterscale.runtime.ranks import RankLayout, attached_trainer, end_rank, make_trainer, start_rank
from rasterscale.scene import Scene
from rasterscale.settings import Settings, TrainSettings
from rasterscale.tasks.api import SizedDataset, Task, TrainingModule
from rasterscale.tasks.registry import task_spec
from rasterscale.train.resume import (
    ResumeCheckpoints,
    StoppedBySignal,
    exit_stopped,
    find_resume_point,
    init_training_worker,
    remove_training_resume_dir,
    training_fingerprint,
    training_resume_dir,
    write_metrics,
)

LOGGER_NAME = "rasterscale.train"


class TrainingDataModule(L.LightningDataModule):
    """Training and validation samples of every training scene, made by the task from their manifests' tiles;
    each rank takes its share of every epoch's samples (:mod:`rasterscale.datasets.sampling`), from where an interrupted
    run stopped in the epoch it resumes (:meth:`resume_at`, before the dataloader is made)."""

    def __init__(
        self, task: Task, scenes: list[Scene], model_cfg: Any, sizes: BatchSizes, train: TrainSettings
    ) -> None:
        super().__init__()
        self.task, self.scenes, self.model_cfg, self.sizes, self.train = task, scenes, model_cfg, sizes, train
        self.train_sets: list[FlippableSamples] = []
        self.val_sets: list[SizedDataset] = []
        self.resumed: tuple[int, int] | None = None  # (epoch, batches its interrupted run took)

    def resume_at(self, epoch: int, batches: int) -> None:
        self.resumed = (epoch, batches)

    def setup(self, stage: str) -> None:
        for scene in self.scenes:
            raster = check_raster(scene.raster)
            tiles = tiles_from_frame(read_manifest(scene.manifest))
            train, validation = split_train_validation(tiles, raster.height, self.train.validation_fraction)
            spec = read_spec(scene.manifest)
            train_set, val_set = self.task.training_datasets(scene, self.model_cfg, train, validation, spec, self.train)
            self.train_sets.append(train_set)
            if val_set is not None:
                self.val_sets.append(val_set)

    def train_dataloader(self) -> DataLoader:
        workers = self.train.workers
        samples = KeyedSamples(self.train_sets, self.train.seed)
        trainer, batch = attached_trainer(self), self.sizes.per_device_batch
        sampler = EpochSampler(samples, trainer.world_size, trainer.global_rank, self.train.seed, batch)
        if self.resumed is not None:
            sampler.resume_at(*self.resumed)
        return DataLoader(
            samples,
            batch_size=batch,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            worker_init_fn=partial(init_training_worker, rank=trainer.global_rank, rank_pid=os.getpid())
            if workers > 0
            else None,
            collate_fn=self.task.collate,
            drop_last=False,
        )


class RankZeroProgress(L.Callback):
    """Progress lines from rank 0 only: step, epoch, loss, learning rate and global images per second."""

    def __init__(self, every_n_steps: int, sizes: BatchSizes) -> None:
        self.every, self.sizes = every_n_steps, sizes
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every:
            return
        elapsed = time.perf_counter() - self._t0
        images = self.every * self.sizes.effective_batch
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        total = trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
        _logger().info(
            "step %d/%d epoch %d loss %.4f lr %.3g %.1f images/s",
            step,
            total,
            trainer.current_epoch,
            loss,
            lr,
            images / elapsed,
        )
        self._t0 = time.perf_counter()


def _logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


class RankZeroValidation(L.Callback):
    """Validation by rank 0 alone every n epochs and at the end; the other ranks wait at a barrier. It leaves
    training's random state as it found it (so a run resumed at an epoch's end goes on as the uninterrupted one)."""

    def __init__(self, task: Task, datamodule: TrainingDataModule, every_n_epochs: int, batch_size: int) -> None:
        self.task, self.datamodule, self.every, self.batch_size = task, datamodule, every_n_epochs, batch_size
        self.last: dict[str, float] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        max_epochs = trainer.max_epochs
        assert max_epochs is not None  # fit() has resolved it (run_training sets train.epochs) before any epoch
        last_epoch = epoch >= max_epochs or (0 < trainer.max_steps <= trainer.global_step)
        if not self.datamodule.val_sets or (epoch % self.every and not last_epoch):
            return
        if trainer.is_global_zero:
            with torch.random.fork_rng():  # training's random stream is the same with or without validation
                # Lightning types the hook's module as any LightningModule; it is the task's TrainingModule
                model = cast(TrainingModule, module).model
                self.last = self.task.validate(model, self.datamodule.val_sets, self.batch_size)
            self.last["epoch"] = trainer.current_epoch
            if trainer.logger is not None:
                trainer.logger.log_metrics(self.last, step=trainer.global_step)
            _logger().info(
                "validation epoch %d: %s",
                trainer.current_epoch,
                " ".join(f"{k}={v:.3f}" for k, v in self.last.items() if k != "epoch"),
            )
        trainer.strategy.barrier("rank_zero_validation")


def plot_curves(metrics_csv: str | Path, png_path: str | Path) -> None:
    """Training loss and validation scores over steps, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_csv) as handle:
        rows = list(csv.DictReader(handle))

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(float(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(*series("train_loss"), lw=0.8, label="train loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    for key in sorted({key for row in rows for key in row if key.startswith("val_")}):
        steps, values = series(key)
        if steps:
            ax_val.plot(steps, values, marker="o", label=key)
    ax_val.set_xlabel("step")
    ax_val.set_ylim(0, 1)
    ax_val.legend()
    save_figure(fig, png_path, dpi=100)


def with_input_statistics(model_cfg: Any, scenes: Sequence[Scene]) -> Any:
    """A model configuration whose input statistics are pending (``normalize: auto``) with those of the training
    scenes pooled (each manifest stores its scene's, from a decimated read); any other as it is."""
    bands: InputBands = model_cfg.input
    if not bands.pending:
        return model_cfg
    statistics = []
    for scene in scenes:
        spec = read_spec(scene.manifest)
        if spec.statistics is None:
            raise InputError(f"{scene.manifest}: the tile manifest holds no band statistics; rerun rule tiles")
        statistics.append(spec.statistics)
    if not statistics:
        raise InputError("normalize: auto computes the statistics from the training scenes, and there is none")
    mean, std = pooled_statistics(statistics)
    try:
        return replace(model_cfg, input=bands.with_statistics(mean, std))
    except ValueError as err:  # a constant band: std 0
        raise InputError(f"normalize: auto over {', '.join(s.name for s in scenes)}: {err}") from None


def training_batch_sizes(train: TrainSettings, world_size: int) -> BatchSizes:
    """The batch sizes of the ``train`` section's batch size and learning rate over ``world_size`` ranks."""
    return batch_sizes(train.batch_size, world_size, train.lr, train.lr_reference_batch, train.lr_scaling)


def training_trainer(
    layout: RankLayout, train: TrainSettings, csv_logger: CSVLogger, callbacks: list[L.Callback]
) -> L.Trainer:
    """The trainer of the run: the ``train`` section's epochs, steps and logging, the run's ranks."""
    return make_trainer(
        layout,
        max_epochs=train.epochs,
        max_steps=train.max_steps,
        logger=csv_logger,
        log_every_n_steps=train.log_every_n_steps,
        callbacks=callbacks,
        use_distributed_sampler=False,  # each rank's share is the EpochSampler's
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        gradient_clip_val=10.0,
    )


def fit(
    trainer: L.Trainer,
    module: TrainingModule,
    datamodule: TrainingDataModule,
    checkpoint: Path | None,
    logger: logging.Logger,
) -> float:
    """Train (from ``checkpoint`` when resuming); the seconds it took. A stop by signal ends the rank at once
    (with the checkpoint it left, a rerun resumes)."""
    # Lightning warns of a resume within an epoch unless the dataloader itself is resumable; the samples are
    # (EpochSampler, told by the checkpoint how many batches of the epoch were taken)
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    started = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint, weights_only=True)  # no pickled code
    except StoppedBySignal as stop:
        if trainer.is_global_zero:
            logger.error("%s", stop)
        end_rank()
        exit_stopped()
    return time.perf_counter() - started


def save_trained(
    task: Task,
    module: TrainingModule,
    model_cfg: Any,
    model_path: str | Path,
    sizes: BatchSizes,
    trainer: L.Trainer,
    seconds: float,
    validation: Mapping[str, float],
) -> list[Path]:
    """Write the trained model with what its training was (the task's files); returns the files."""
    return task.save_model(
        module.model,
        model_cfg,
        model_path,
        batch_sizes=sizes.describe(),
        steps=int(trainer.global_step),
        epochs=int(trainer.current_epoch),
        seconds=round(seconds, 1),
        precision=str(trainer.precision),
        validation=validation,
    )


def run_training(
    scenes: list[Scene],
    settings: Settings,
    layout: RankLayout,
    model_path: str | Path,
    metrics_path: str | Path,
    plot_path: str | Path,
    log_dir: str | Path,
) -> None:
    """Train the config's task with ``layout.world_size`` ranks, starting from ``train.init`` or
    ``model.backbone_weights`` when given; rank 0 writes the model (and what the task writes beside it), the
    metrics CSV and the plot."""
    train = settings.train
    logger = start_rank(layout, log_dir, LOGGER_NAME)
    task = task_spec(settings.task).load()
    model_cfg = with_input_statistics(task.model_config(settings), scenes)
    sizes = training_batch_sizes(train, layout.world_size)
    L.seed_everything(train.seed, workers=True, verbose=False)
    datamodule = TrainingDataModule(task, scenes, model_cfg, sizes, train)
    module = task.training_module(model_cfg, sizes, train)
    loaded = task.initial_weights(module.model, model_cfg, settings)
    validation = RankZeroValidation(task, datamodule, train.val_every_n_epochs, sizes.per_device_batch)
    folder = training_resume_dir(model_path)
    run_fingerprint = training_fingerprint(settings, scenes, layout.world_size)
    resume = find_resume_point(folder, run_fingerprint)
    csv_logger = CSVLogger(save_dir=str(log_dir), name="lightning", version="")
    logged = Path(csv_logger.log_dir, "metrics.csv")
    every = train.checkpoint_every_n_steps
    checkpoints = ResumeCheckpoints(
        folder, run_fingerprint, every, logger, (resume.earlier_metrics(), logged), datamodule.resume_at
    )
    callbacks = [RankZeroProgress(train.log_every_n_steps, sizes), validation, checkpoints]
    trainer = training_trainer(layout, train, csv_logger, callbacks)
    if trainer.is_global_zero:
        logger.info("batch sizes: %s", sizes.describe())
        logger.info("run: %s", layout)
        logger.info("start: %s", loaded)
        logger.info("%s: %s", task.spec.name, task.describe(model_cfg))
        logger.info("%s", resume.why)
    seconds = fit(trainer, module, datamodule, resume.checkpoint, logger)
    if not trainer.is_global_zero:
        end_rank()
        return
    csv_logger.finalize("success")
    written = save_trained(task, module, model_cfg, model_path, sizes, trainer, seconds, validation.last)
    write_metrics(checkpoints.metrics(), metrics_path)
    plot_curves(metrics_path, plot_path)
    logger.info(
        "trained %d steps in %.0f s; wrote %s", trainer.global_step, seconds, ", ".join(str(p) for p in written)
    )
    remove_training_resume_dir(folder)
    end_rank()
