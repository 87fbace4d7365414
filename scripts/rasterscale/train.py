"""DDP training of the detector with Lightning.

Batch semantics are explicit: ``train.batch_size`` is the effective global batch, each rank loads
``ceil(batch_size / world_size)`` tiles, and the learning rate follows the effective batch when
``lr_scaling: linear``. The plan is logged once, by rank 0, before the first step. Only rank 0 logs progress,
validates (on tiles of a held-out band of each training scene) and writes the checkpoint, the training curves
(CSV) and their plot.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import ConcatDataset, DataLoader

from rasterscale.batching import BatchPlan, plan_batches
from rasterscale.data import TrainTileDataset, collate_lists
from rasterscale.evaluate import evaluate_detections
from rasterscale.imagery import on_data, read_spec
from rasterscale.inputs import check_raster, read_annotations
from rasterscale.model import (
    DetectorConfig,
    build_detector,
    freeze_pretrained_backbone,
    init_from_model_file,
    load_backbone_weights,
    save_checkpoint,
)
from rasterscale.modelfiles import write_deepforest_folder
from rasterscale.runtime import (
    RunSpec,
    cpu_threads_per_rank,
    current_rank,
    make_trainer,
    quiet_non_zero_ranks,
    setup_rank_logging,
)
from rasterscale.tiling import Tile, read_manifest, tiles_from_frame

LOGGER_NAME = "rasterscale.train"


@dataclass(frozen=True)
class TrainScene:
    name: str
    raster: str
    manifest: str
    annotations: str
    label_column: str | None = None
    image_path: str | None = None  # the scene's image name in CSV/VOC annotations


def split_train_validation(tiles: list[Tile], raster_height: int, validation_fraction: float) -> tuple[list, list]:
    """Tiles wholly above the held-out bottom band train; tiles wholly inside it validate; the rest are unused."""
    if validation_fraction <= 0:
        return tiles, []
    boundary = raster_height * (1.0 - validation_fraction)
    train = [t for t in tiles if t.row_off + t.height <= boundary]
    validation = [t for t in tiles if t.row_off >= boundary]
    return train, validation


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 5% of the peak."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))


def initial_weights(model: torch.nn.Module, detector: DetectorConfig, init: str, backbone_weights: str) -> str:
    """Start the detector from ``train.init`` (any model file rasterscale reads), or its backbone from
    ``model.backbone_weights`` (a torchvision ImageNet ResNet), or from scratch; returns what for the log.
    A pretrained backbone is fine-tuned as DeepForest does (frozen batch norms and stem)."""
    if init:
        loaded = init_from_model_file(model, detector, init)
    elif backbone_weights:
        loaded = load_backbone_weights(model, backbone_weights) + ", the rest initialized at random"
    else:
        return "no weights: training from scratch (random initialization)"
    return f"{loaded}; {freeze_pretrained_backbone(model)}"


def log_deepforest_compatibility(detector: DetectorConfig, folder: str | Path) -> None:
    """DeepForest's RetinaNetHub builds a resnet50 (torchvision's retinanet_resnet50_fpn) whatever the folder."""
    if detector.backbone != "resnet50":
        _logger().warning(
            "%s: written for rasterscale (model.checkpoint reads it); DeepForest itself builds resnet50 models only "
            "and cannot load this %s",
            folder,
            detector.backbone,
        )


class DetectorTrainingModule(L.LightningModule):
    def __init__(self, detector: DetectorConfig, plan: BatchPlan, train_cfg: dict[str, Any]) -> None:
        super().__init__()
        self.detector_cfg, self.plan, self.train_cfg = detector, plan, train_cfg
        self.model = build_detector(detector)  # its transform resizes as the model records (model.resize)

    def training_step(self, batch: tuple[list, list], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        losses = self.model(images, targets)
        loss = sum(losses.values())
        self.log("train_loss", loss.detach(), batch_size=len(images), prog_bar=False)
        for name, value in losses.items():
            self.log(f"train_{name}", value.detach(), batch_size=len(images))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.plan.lr, weight_decay=self.train_cfg["weight_decay"])
        total = int(self.trainer.estimated_stepping_batches)
        warmup = min(self.train_cfg["warmup_steps"], max(0, total // 5))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class TrainingDataModule(L.LightningDataModule):
    """Training and validation tiles of every training scene, cut from their manifests."""

    def __init__(self, scenes: list[TrainScene], detector: DetectorConfig, plan: BatchPlan, cfg: dict) -> None:
        super().__init__()
        self.scenes, self.detector, self.plan, self.cfg = scenes, detector, plan, cfg
        self.train_sets: list[TrainTileDataset] = []
        self.val_sets: list[TrainTileDataset] = []

    def setup(self, stage: str) -> None:
        for scene in self.scenes:
            raster = check_raster(scene.raster)
            labels = list(self.detector.labels)
            truth = read_annotations(scene.annotations, raster, labels, scene.label_column, scene.image_path)
            tiles = tiles_from_frame(read_manifest(scene.manifest))
            spec = read_spec(scene.manifest)
            keep = on_data(scene.raster, spec, truth.boxes)  # boxes on masked pixels: the tiles show none
            train, validation = split_train_validation(tiles, raster.height, self.cfg["validation_fraction"])
            common = {
                "boxes": truth.boxes[keep],
                "labels": truth.labels[keep],
                "min_visible_fraction": self.cfg["min_visible_fraction"],
            }
            self.train_sets.append(TrainTileDataset(scene.raster, train, spec, augment=True, **common))
            if validation:
                self.val_sets.append(TrainTileDataset(scene.raster, validation, spec, augment=False, **common))

    def train_dataloader(self) -> DataLoader:
        workers = self.cfg["workers"]
        return DataLoader(
            ConcatDataset(self.train_sets),
            batch_size=self.plan.per_device_batch,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            collate_fn=collate_lists,
            drop_last=False,
        )


class RankZeroProgress(L.Callback):
    """Progress lines from rank 0 only: step, epoch, loss, learning rate and global images per second."""

    def __init__(self, every_n_steps: int, plan: BatchPlan) -> None:
        self.every, self.plan = every_n_steps, plan
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every:
            return
        elapsed = time.perf_counter() - self._t0
        images = self.every * self.plan.effective_batch
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


def predict_tiles(model: torch.nn.Module, dataset: TrainTileDataset, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Run the raw detector over a tile dataset (rank 0 only: no collectives)."""
    was_training = model.training
    model.eval()
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(dataset), batch_size):
            images = [dataset[i][0] for i in range(start, min(len(dataset), start + batch_size))]
            outputs.extend({k: v.float().numpy() for k, v in o.items()} for o in model(images))
    model.train(was_training)
    return outputs


def validate(model: torch.nn.Module, datasets: list[TrainTileDataset], batch_size: int) -> dict[str, float]:
    """Tile-level precision/recall/F1 (IoU 0.4) and mAP@0.5 on the validation tiles."""
    pred_boxes, pred_scores, pred_labels, gt_boxes, gt_labels = [], [], [], [], []
    offset = 0.0
    for dataset in datasets:
        for index, out in enumerate(predict_tiles(model, dataset, batch_size)):
            target = dataset.target(index)
            # place each tile in its own region of a virtual plane so that tiles never match across
            shift = np.array([offset, 0, offset, 0])
            pred_boxes.append(out["boxes"] + shift)
            pred_scores.append(out["scores"])
            pred_labels.append(out["labels"])
            gt_boxes.append(target["boxes"].numpy() + shift)
            gt_labels.append(target["labels"].numpy())
            offset += 1e5
    metrics = evaluate_detections(
        np.concatenate(pred_boxes),
        np.concatenate(pred_scores),
        np.concatenate(pred_labels),
        np.concatenate(gt_boxes),
        np.concatenate(gt_labels),
        iou_threshold=0.4,
        score_threshold=float(model.score_thresh),
    )
    return {f"val_{k}": float(metrics[k]) for k in ("precision", "recall", "f1", "map50")}


class RankZeroValidation(L.Callback):
    """Validation by rank 0 alone every n epochs and at the end; the other ranks wait at a barrier."""

    def __init__(self, datamodule: TrainingDataModule, every_n_epochs: int, batch_size: int) -> None:
        self.datamodule, self.every, self.batch_size = datamodule, every_n_epochs, batch_size
        self.last: dict[str, float] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        last_epoch = epoch >= trainer.max_epochs or (0 < trainer.max_steps <= trainer.global_step)
        if not self.datamodule.val_sets or (epoch % self.every and not last_epoch):
            return
        if trainer.is_global_zero:
            self.last = validate(module.model, self.datamodule.val_sets, self.batch_size)
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

    from rasterscale.outputs import atomic_path

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
    for key in ("val_f1", "val_precision", "val_recall", "val_map50"):
        steps, values = series(key)
        if steps:
            ax_val.plot(steps, values, marker="o", label=key)
    ax_val.set_xlabel("step")
    ax_val.set_ylim(0, 1)
    ax_val.legend()
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def run_training(
    scenes: list[TrainScene],
    detector: DetectorConfig,
    train_cfg: dict[str, Any],
    spec: RunSpec,
    checkpoint_path: str | Path,
    metrics_path: str | Path,
    plot_path: str | Path,
    log_dir: str | Path,
    deepforest_folder: str | Path | None = None,
    backbone_weights: str = "",
) -> None:
    """Train with ``spec.world_size`` ranks, starting from ``train.init`` or ``backbone_weights`` when given;
    rank 0 writes the checkpoint, the DeepForest model folder, the metrics CSV and the plot."""
    rank = current_rank()
    logger = setup_rank_logging(rank, log_dir, name=LOGGER_NAME)
    quiet_non_zero_ranks(rank)
    plan = plan_batches(
        train_cfg["batch_size"],
        spec.world_size,
        train_cfg["lr"],
        train_cfg["lr_reference_batch"],
        train_cfg["lr_scaling"],
    )
    if spec.accelerator == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(spec.devices))
    L.seed_everything(train_cfg["seed"], workers=True, verbose=False)
    datamodule = TrainingDataModule(scenes, detector, plan, train_cfg)
    module = DetectorTrainingModule(detector, plan, train_cfg)
    loaded = initial_weights(module.model, detector, train_cfg.get("init", ""), backbone_weights)
    validation = RankZeroValidation(datamodule, train_cfg["val_every_n_epochs"], plan.per_device_batch)
    csv_logger = CSVLogger(save_dir=str(log_dir), name="lightning", version="")
    trainer = make_trainer(
        spec,
        max_epochs=train_cfg["epochs"],
        max_steps=train_cfg["max_steps"],
        logger=csv_logger,
        log_every_n_steps=train_cfg["log_every_n_steps"],
        callbacks=[RankZeroProgress(train_cfg["log_every_n_steps"], plan), validation],
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        gradient_clip_val=10.0,
    )
    if trainer.is_global_zero:
        logger.info("batch plan: %s", plan.describe())
        logger.info("run: %s", spec)
        logger.info("start: %s", loaded)
        logger.info("detector: %s, %s", detector.backbone, detector.describe())
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    if not trainer.is_global_zero:
        return
    seconds = time.perf_counter() - started
    csv_logger.finalize("success")
    save_checkpoint(
        module.model,
        detector,
        checkpoint_path,
        batch_plan=plan.describe(),
        steps=int(trainer.global_step),
        epochs=int(trainer.current_epoch),
        seconds=round(seconds, 1),
        validation=validation.last,
    )
    if deepforest_folder is not None:
        write_deepforest_folder(module.model.state_dict(), detector, deepforest_folder)
        log_deepforest_compatibility(detector, deepforest_folder)
    from rasterscale.outputs import atomic_path

    logged = Path(csv_logger.log_dir, "metrics.csv")
    with atomic_path(metrics_path) as tmp:
        tmp.write_bytes(logged.read_bytes() if logged.exists() else b"step,epoch\n")
    plot_curves(metrics_path, plot_path)
    logger.info(
        "trained %d steps in %.0f s; checkpoint %s, DeepForest model folder %s",
        trainer.global_step,
        seconds,
        checkpoint_path,
        deepforest_folder,
    )
