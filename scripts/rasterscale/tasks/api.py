"""The task interface: what the task-neutral core (training, prediction) asks of a task.

The core owns everything that does not depend on what is predicted: tile manifests, the batch sizes, launching
ranks, sharding tiles over shards and ranks, reading tiles, the rank's profile and its record of processed tiles
(:mod:`rasterscale.jobs.rankfiles`), the exactly-once check. A task owns its model, its training samples and how a
batch's output becomes a rank output; how rank outputs merge into a scene's layers, and how they are scored, is
its :class:`~rasterscale.tasks.spec.TaskSpec`'s (no torch: a merge job does not load it).
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any, ClassVar, Protocol

import lightning as L
import torch

from rasterscale.datasets.sampling import FlippableSamples
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.imagery import ImageSpec
from rasterscale.runtime.batching import BatchSizes
from rasterscale.scene import Scene
from rasterscale.settings import PredictSettings, Settings, TrainSettings
from rasterscale.tasks.spec import Part, TaskSpec


class SizedDataset(Protocol):
    """Samples by index that know their number (a map-style dataset with ``__len__``, which torch's ``Dataset``
    leaves to its subclasses): a task's validation samples."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass(frozen=True)
class PredictScene:
    """A scene of a prediction job: its raster, its tiles, imagery spec and tile grid (from its manifest), and its
    raster's size and georeference."""

    name: str
    raster: str
    tiles: list[Tile]
    imagery: ImageSpec
    grid: TileGrid
    width: int
    height: int
    transform: Any
    crs: Any


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's parameters are on, where its inputs go (validation runs the training model where it
    trains: rank 0's GPU, whose tiles come from the host)."""
    return next(model.parameters()).device


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 5% of the peak."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainingModule(L.LightningModule):
    """The Lightning module of every task: the task's model, its loss, and one optimizer and schedule for all
    (AdamW at the batch sizes' learning rate, warm-up then cosine)."""

    def __init__(self, model: torch.nn.Module, sizes: BatchSizes, train: TrainSettings) -> None:
        super().__init__()
        self.model, self.sizes, self.train_settings = model, sizes, train  # (Module.train is a method)

    def losses(self, batch: Any) -> dict[str, torch.Tensor]:
        """The task's loss terms of a batch (their sum is optimized)."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = self.losses(batch)
        # the terms added in order: sum()'s start, the int 0, adds nothing (a tensor start would promote bf16 to fp32)
        loss: torch.Tensor = reduce(operator.add, losses.values())
        size = len(batch[0])
        self.log("train_loss", loss.detach(), batch_size=size)
        for name, value in losses.items():
            self.log(f"train_{name}", value.detach(), batch_size=size)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.sizes.lr, weight_decay=self.train_settings.weight_decay
        )
        total = int(self.trainer.estimated_stepping_batches)
        warmup = min(self.train_settings.warmup_steps, max(0, total // 5))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class RankOutput(ABC):
    """One rank's output of one scene, filled batch by batch in prediction order and written once at the end, from
    the parts of a previous run of the rank (:mod:`rasterscale.jobs.resume`) and the tiles predicted since."""

    @abstractmethod
    def add_batch(self, tiles: Sequence[Tile], result: Any) -> None:
        """A batch of predicted tiles' result, as :meth:`Task.postprocess` made it (on the rank's device), cut to
        these tiles (``result[i:j]``: a tensor's first dimension, a list's items)."""

    def stage_seconds(self) -> dict[str, float]:
        """Seconds so far of the stages the output runs inside :meth:`add_batch` and beside it: ``d2h`` (copies of
        results to the host the rank waited for), ``write_wait`` (the rank waiting for a writer thread), and
        ``writer`` (a writer thread's own time, in parallel with the rank). None run: none given."""
        return {}

    @abstractmethod
    def save_part(self, path: Path) -> Part | None:
        """Write, atomically at ``path``, what the output holds of finished own tiles and no part holds yet;
        the part (with the own tile_ids it vouches for), or None when there is nothing new."""

    def unsaved_bytes(self) -> int:
        """Finished data held for the next part (a part is written early when it grows large)."""
        return 0

    @abstractmethod
    def write(self) -> str:
        """Write the output atomically (the parts and the rest); return what it holds, for the log (e.g. "12
        detections")."""


class Task(ABC):
    """One kind of prediction over rasters (see the module docstring for what the core does instead)."""

    spec: ClassVar[TaskSpec]

    # --- the model -----------------------------------------------------------------------------------------
    @abstractmethod
    def model_config(self, settings: Settings) -> Any:
        """The effective model configuration: the config's model keys over the model file's (dry-run cheap)."""

    @abstractmethod
    def describe(self, model_cfg: Any) -> str:
        """One line for the logs."""

    @abstractmethod
    def build_model(self, model_cfg: Any) -> torch.nn.Module:
        """A fresh (untrained) model."""

    @abstractmethod
    def load_model(self, path: str | Path, settings: Settings) -> tuple[torch.nn.Module, Any]:
        """A trained model file's model and its effective configuration."""

    # --- training ------------------------------------------------------------------------------------------
    training_module_class: ClassVar[type[TrainingModule]]

    def training_module(self, model_cfg: Any, sizes: BatchSizes, train: TrainSettings) -> TrainingModule:
        """A fresh model in the task's Lightning module."""
        return self.training_module_class(self.build_model(model_cfg), sizes, train)

    @abstractmethod
    def initial_weights(self, model: torch.nn.Module, model_cfg: Any, settings: Settings) -> str:
        """Start the model from train.init / model.backbone_weights (or not); returns what, for the log."""

    @abstractmethod
    def training_datasets(
        self,
        scene: Scene,
        model_cfg: Any,
        train: Sequence[Tile],
        validation: Sequence[Tile],
        spec: ImageSpec,
        train_settings: TrainSettings,
    ) -> tuple[FlippableSamples, SizedDataset | None]:
        """A scene's training samples (flipped by the sampler: :mod:`rasterscale.datasets.sampling`) and validation
        samples, made from its tiles."""

    @abstractmethod
    def collate(self, batch: list[Any]) -> Any:
        """A training batch from samples."""

    @abstractmethod
    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        """Validation scores (``val_*``) of the model on validation samples (host tensors: each batch goes to the
        model's device, :func:`model_device`, and its output comes back)."""

    @abstractmethod
    def save_model(self, model: torch.nn.Module, model_cfg: Any, model_path: str | Path, **meta: Any) -> list[Path]:
        """Write the trained model (``results/models/{name}.pt`` and anything beside it); returns the files."""

    # --- prediction ----------------------------------------------------------------------------------------
    @abstractmethod
    def prepare_for_inference(self, model: torch.nn.Module, predict: PredictSettings) -> torch.nn.Module:
        """The model's fast path (eval mode, folded norms, channels_last...)."""

    def forward(self, model: torch.nn.Module, images: torch.Tensor) -> Any:
        """The model over a batch of tiles, (B, C, H, W) float on the device ([0, 1] scaled, or raw values): its
        raw output."""
        return model(images)

    @abstractmethod
    def postprocess(self, raw: Any) -> Any:
        """A batch's raw output as the rank output takes it, still on the device: one result per tile along a
        tensor's first dimension, or a list of them."""

    def tiles_to_predict(self, scene: PredictScene, own: Sequence[Tile]) -> list[Tile]:
        """The tiles a rank predicts for its own tiles (a blending task also needs their neighbours')."""
        return list(own)

    @abstractmethod
    def rank_output(
        self,
        scene: PredictScene,
        own: Sequence[Tile],
        predicted: Sequence[Tile],
        path: str | Path,
        model_cfg: Any,
        settings: Settings,
        parts: Sequence[Part] | None = None,
        device: torch.device | None = None,
    ) -> RankOutput:
        """The rank's output of a scene at ``path`` (``{stem}{info.rank_suffix}``). ``own``: all the rank's tiles
        of the scene; ``parts``: what a previous run of the rank wrote of them (their tiles are not predicted
        again), None when the rank saves no parts (then :meth:`RankOutput.save_part` is never called);
        ``predicted``: what the rest needs (:meth:`tiles_to_predict` of the own tiles not in a part); ``device``: the
        rank's (the CPU when None), where the results come."""
