"""Regression: a value per pixel (or K values, ``model.labels``) with a segmentation-models-pytorch U-Net, one
float32 COG of values per scene.

Training minimizes ``model.loss`` (l1, mse or huber) between the network's standardized outputs and the targets
standardized by the training tiles' mean and std (measured when training starts, stored in the model file), left
out where the target has no data or the imagery is masked. Each rank blends its tiles' values with weights that
taper toward inner tile edges and writes the values of its own tiles' cores (:mod:`.blend`, memory flat however
large the raster); the merge assembles the cores into ``values.tif`` (:mod:`.merge`). The library is
:mod:`rasterscale.tasks.regression`; this module is what the core asks of it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.scene import Scene
from rasterscale.settings import PredictSettings, Settings, TrainSettings
from rasterscale.tasks.api import SizedDataset, TrainingModule, model_device
from rasterscale.tasks.dense import (
    DenseTask,
    DenseTileDataset,
    collate_stack,
    prepare_dense_for_inference,
    start_from_same_network,
)
from rasterscale.tasks.exported.card import ModelCard
from rasterscale.tasks.exported.resolve import exported_model
from rasterscale.tasks.exported.runtime import ExportedDense
from rasterscale.tasks.regression.blend import ValueBlender
from rasterscale.tasks.regression.dataset import RegressionTileDataset, target_scale
from rasterscale.tasks.regression.groundtruth import read_targets
from rasterscale.tasks.regression.metrics import ErrorSums
from rasterscale.tasks.regression.model import (
    Regressor,
    build_regressor,
    load_regressor,
    save_regressor,
    start_encoder,
)
from rasterscale.tasks.regression.modelfiles import RegressorConfig
from rasterscale.tasks.regression.spec import CARD, REGRESSION, regression_model

HUBER_DELTA = 1.0  # in standardized units: one std of the targets
TRAIN_LOGGER = "rasterscale.train"  # the training job's log


def masked_loss(predicted: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    """``kind`` (l1, mse, huber) of ``predicted`` against ``targets`` (N, K, H, W), averaged over the pixels whose
    target is known (NaN: no data, left out); 0 (with a gradient) when none is."""
    known = torch.isfinite(targets)
    if not bool(known.any()):
        return predicted.sum() * 0.0
    diff = predicted[known].float() - targets[known].float()
    if kind == "l1":
        return diff.abs().mean()
    if kind == "mse":
        return (diff**2).mean()
    if kind == "huber":
        return torch.nn.functional.huber_loss(diff, torch.zeros_like(diff), delta=HUBER_DELTA)
    raise ValueError(f"unknown loss {kind!r}")


def regressor_of(model: torch.nn.Module) -> Regressor:
    """The task's model, typed (a DDP wrapper's ``.module``)."""
    return cast(Regressor, getattr(model, "module", model))


class RegressionTrainingModule(TrainingModule):
    """The regressor trained on standardized targets; the targets' scale is measured on the training tiles when
    training starts (every rank the same, from the same tiles)."""

    loss_kind = "l1"  # model.loss, and the values' names: set by RegressionTask.training_module
    labels: tuple[str, ...] = ()

    def on_fit_start(self) -> None:
        datamodule = cast(Any, self.trainer).datamodule
        datasets = [d for d in datamodule.train_sets if isinstance(d, RegressionTileDataset)]
        regressor = regressor_of(self.model)
        regressor.set_target_scale(*target_scale(datasets, self.labels))
        if self.trainer.is_global_zero:
            mean, std = regressor.target_scale
            scale = ", ".join(f"{m:.4g} ± {s:.4g}" for m, s in zip(mean, std, strict=True))
            logging.getLogger(TRAIN_LOGGER).info("targets on the training tiles: %s (the outputs' scale)", scale)

    def losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, targets = batch
        regressor = regressor_of(self.model)
        predicted = self.model(images)
        return {
            self.loss_kind: masked_loss(
                regressor.standardized(predicted), regressor.standardized(targets), self.loss_kind
            )
        }


def validate_regressor(model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
    """MAE, RMSE and R² of the first value on the validation tiles, in target units (rank 0 only: no collectives)."""
    was_training, device = model.training, model_device(model)
    model.eval()
    sums = ErrorSums()
    with torch.inference_mode():
        for dataset in datasets:
            for start in range(0, len(dataset), batch_size):
                images, targets = collate_stack(
                    [dataset[i] for i in range(start, min(len(dataset), start + batch_size))]
                )
                predicted = model(images.to(device))[:, 0].float().cpu().numpy()
                true = targets[:, 0].numpy()
                known = np.isfinite(predicted) & np.isfinite(true)
                sums.add(predicted[known], true[known])
    model.train(was_training)
    scores = sums.scores()
    if not scores["pixels"]:
        return {}
    found = {"val_mae": scores["mae"], "val_rmse": scores["rmse"], "val_r2": scores["r2"]}
    return {key: float(value) for key, value in found.items() if value is not None}


class RegressionTask(DenseTask):
    spec = REGRESSION
    training_module_class = RegressionTrainingModule
    blender = ValueBlender
    blended = "values"

    def model_config(self, settings: Settings) -> RegressorConfig | ModelCard:
        return regression_model(settings, check=False)

    def build_model(self, model_cfg: RegressorConfig) -> torch.nn.Module:
        return build_regressor(model_cfg)

    def training_module(self, model_cfg: RegressorConfig, plan: Any, train: TrainSettings) -> TrainingModule:
        module = super().training_module(model_cfg, plan, train)
        regression = cast(RegressionTrainingModule, module)
        regression.loss_kind, regression.labels = model_cfg.loss, model_cfg.labels
        return module

    def load_model(self, path: str | Path, settings: Settings) -> tuple[torch.nn.Module, RegressorConfig | ModelCard]:
        exported = exported_model(path, settings, CARD)
        if exported is not None:
            return exported
        model, cfg, _ = load_regressor(path)
        return model, cfg

    def start_encoder(self, model: torch.nn.Module, model_cfg: RegressorConfig, path: str) -> str:
        return start_encoder(model, model_cfg, path)

    def start_from(self, model: torch.nn.Module, model_cfg: RegressorConfig, init: str) -> str:
        """Start from ``init``, a rasterscale regressor on the same encoder (its head too when it predicts as many
        values)."""
        start, start_cfg, _ = load_regressor(init)
        return start_from_same_network(model, model_cfg, start, start_cfg, init)

    def tile_samples(
        self, scene: Scene, model_cfg: RegressorConfig, spec: ImageSpec
    ) -> Callable[[Sequence[Tile]], DenseTileDataset]:
        targets = read_targets(scene.annotations, scene.raster, model_cfg.labels)
        return functools.partial(RegressionTileDataset, scene.raster, spec=spec, targets=targets)

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_regressor(model, datasets, batch_size)

    def save_model(
        self, model: torch.nn.Module, model_cfg: RegressorConfig, model_path: str | Path, **meta: Any
    ) -> list[Path]:
        save_regressor(model, model_cfg, model_path, **meta)
        return [Path(model_path)]

    def prepare_for_inference(self, model: torch.nn.Module, predict: PredictSettings) -> torch.nn.Module:
        if isinstance(model, ExportedDense):
            return model.prepare(predict.channels_last)
        return prepare_dense_for_inference(model, regressor_of(model).net, predict.channels_last)

    def postprocess(self, raw: torch.Tensor) -> torch.Tensor:
        """The values, in fp32."""
        return raw.float()

    def blended_bands(self, model_cfg: RegressorConfig | ModelCard) -> Sequence[str]:
        return model_cfg.labels
