"""Points: objects as points (tree tops, birds) found as the peaks of a heatmap that a segmentation-models-pytorch
network predicts, one channel per class.

Training minimizes ``model.loss`` between the heatmap and Gaussians of ``model.sigma`` metres around the true points
(:mod:`.dataset`): CenterNet's penalty-reduced focal loss (the default) or the mean squared error, left out where
the imagery is masked. At prediction each rank predicts its own tiles only; each batch's heatmaps are decoded on the
device (:mod:`.decode`: a max-pool NMS of two sigmas, ``model.score_threshold``, the top
``model.detections_per_tile``), and a tile keeps the points its core holds (:mod:`.rankoutput`). The merge removes
what is left of duplicates within ``merge.point_distance`` (:mod:`.merge`). This module is what the core asks of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import ImageSpec
from rasterscale.scene import Scene
from rasterscale.settings import PredictSettings, Settings, TrainSettings
from rasterscale.tasks.api import PredictScene, RankOutput, SizedDataset, TrainingModule, model_device
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
from rasterscale.tasks.pointmatching import match_points
from rasterscale.tasks.points.dataset import PointTileDataset
from rasterscale.tasks.points.decode import decode_peaks
from rasterscale.tasks.points.groundtruth import read_points
from rasterscale.tasks.points.model import (
    PointModel,
    build_points_model,
    load_points_model,
    save_points_model,
    start_encoder,
)
from rasterscale.tasks.points.modelfiles import PEAK_SIGMAS, PointsConfig, peak_rule, peak_window, with_prediction_keys
from rasterscale.tasks.points.rankoutput import PointsRankOutput
from rasterscale.tasks.points.spec import CARD, POINTS, points_model
from rasterscale.tasks.spec import Part

FOCAL_ALPHA, FOCAL_BETA = 2.0, 4.0  # CenterNet's
VALIDATION_SIGMAS = 2.0  # validation matches a peak to a true point within this many sigmas


def focal_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss of heatmap ``logits`` against Gaussian ``targets`` (N, K, H, W; 1 at
    a point's pixel, NaN where left out), summed and divided by the number of points (at least 1)."""
    known = torch.isfinite(targets)
    logits, targets = logits[known].float(), targets[known].float()
    probability = torch.sigmoid(logits)
    positive = targets >= 1.0
    log_p, log_not_p = torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits)
    pos = ((1 - probability) ** FOCAL_ALPHA * log_p)[positive].sum()
    neg = ((1 - targets) ** FOCAL_BETA * probability**FOCAL_ALPHA * log_not_p)[~positive].sum()
    return -(pos + neg) / positive.sum().clamp(min=1)


def heatmap_loss(logits: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    """``kind`` (focal, mse) of the heatmap's logits against its targets; 0 (with a gradient) when no pixel is
    known."""
    known = torch.isfinite(targets)
    if not bool(known.any()):
        return logits.sum() * 0.0
    if kind == "focal":
        return focal_loss(logits, targets)
    if kind == "mse":
        return ((torch.sigmoid(logits[known].float()) - targets[known].float()) ** 2).mean()
    raise ValueError(f"unknown loss {kind!r}")


class PointsTrainingModule(TrainingModule):
    """The point model trained on heatmaps."""

    loss_kind = "focal"  # model.loss: set by PointsTask.training_module

    def losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, targets = batch
        return {self.loss_kind: heatmap_loss(self.model(images), targets, self.loss_kind)}


def tile_scores(dataset: PointTileDataset, heat: torch.Tensor, tiles: Sequence[Tile], threshold: float) -> np.ndarray:
    """(matched, predicted, true) of a batch of a dataset's tiles: peaks scoring at least ``threshold`` matched one
    to one with the tiles' true points within :data:`VALIDATION_SIGMAS` sigmas."""
    distance = VALIDATION_SIGMAS * dataset.sigma_px
    window = peak_window(PEAK_SIGMAS * dataset.sigma_px, 1.0)
    found = decode_peaks(heat, window, threshold, 4096).numpy()
    sums = np.zeros(3, dtype=np.int64)
    for tile, points in zip(tiles, found, strict=True):
        peaks = points[points[:, 2] > 0][:, :2] + 0.5
        truth, _ = dataset.points_of(tile)
        matched, _ = match_points(peaks, truth, distance)
        sums += (len(matched), len(peaks), len(truth))
    return sums


def validate_points(
    model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int, threshold: float
) -> dict[str, float]:
    """Precision, recall and F1 of the peaks on the validation tiles (rank 0 only: no collectives)."""
    was_training, device = model.training, model_device(model)
    model.eval()
    sums = np.zeros(3, dtype=np.int64)
    with torch.inference_mode():
        for dataset in datasets:
            points = cast(PointTileDataset, dataset)
            for start in range(0, len(points), batch_size):
                indexes = range(start, min(len(points), start + batch_size))
                images, _ = collate_stack([points[i] for i in indexes])
                heat = torch.sigmoid(model(images.to(device)).float()).cpu()
                sums += tile_scores(points, heat, [points.tiles[i] for i in indexes], threshold)
    model.train(was_training)
    matched, predicted, true = (int(v) for v in sums)
    if not true and not predicted:
        return {}
    precision = matched / predicted if predicted else 0.0
    recall = matched / true if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"val_precision": precision, "val_recall": recall, "val_f1": f1}


def pixel_size(raster: str) -> float:
    """A raster's pixel size (its CRS units, metres for a projected one), the mean of its two sides."""
    transform = check_raster(raster).transform
    return (abs(transform.a) + abs(transform.e)) / 2


class PointsTask(DenseTask):
    spec = POINTS
    training_module_class = PointsTrainingModule

    def __init__(self) -> None:
        super().__init__()
        self.threshold = 0.3  # the validation's score threshold: the model's, set with its configuration

    def model_config(self, settings: Settings) -> PointsConfig | ModelCard:
        cfg = points_model(settings, check=False)
        if isinstance(cfg, PointsConfig):
            self.threshold = cfg.score_threshold
        return cfg

    def build_model(self, model_cfg: PointsConfig) -> torch.nn.Module:
        return build_points_model(model_cfg)

    def training_module(self, model_cfg: PointsConfig, plan: Any, train: TrainSettings) -> TrainingModule:
        module = super().training_module(model_cfg, plan, train)
        cast(PointsTrainingModule, module).loss_kind = model_cfg.loss
        return module

    def load_model(self, path: str | Path, settings: Settings) -> tuple[torch.nn.Module, PointsConfig | ModelCard]:
        exported = exported_model(path, settings, CARD)
        if exported is not None:
            return exported
        model, cfg, _ = load_points_model(path)
        return model, with_prediction_keys(cfg, settings)

    def start_encoder(self, model: torch.nn.Module, model_cfg: PointsConfig, path: str) -> str:
        return start_encoder(model, model_cfg, path)

    def start_from(self, model: torch.nn.Module, model_cfg: PointsConfig, init: str) -> str:
        """Start from ``init``, a rasterscale point model on the same encoder (its head too when it finds as many
        classes)."""
        start, start_cfg, _ = load_points_model(init)
        return start_from_same_network(model, model_cfg, start, start_cfg, init)

    def tile_samples(
        self, scene: Scene, model_cfg: PointsConfig, spec: ImageSpec
    ) -> Callable[[Sequence[Tile]], DenseTileDataset]:
        raster = check_raster(scene.raster)
        labels = list(model_cfg.labels)
        truth = read_points(scene.annotations or "", raster, labels, scene.label_column or None, scene.image_path)
        sigma_px = model_cfg.sigma / pixel_size(scene.raster)
        return functools.partial(
            PointTileDataset, scene.raster, spec=spec, truth=truth, classes=model_cfg.outputs, sigma_px=sigma_px
        )

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_points(model, datasets, batch_size, self.threshold)

    def save_model(
        self, model: torch.nn.Module, model_cfg: PointsConfig, model_path: str | Path, **meta: Any
    ) -> list[Path]:
        save_points_model(model, model_cfg, model_path, **meta)
        return [Path(model_path)]

    def prepare_for_inference(self, model: torch.nn.Module, predict: PredictSettings) -> torch.nn.Module:
        if isinstance(model, ExportedDense):
            return model.prepare(predict.channels_last)
        net = cast(PointModel, getattr(model, "module", model)).net
        return prepare_dense_for_inference(model, net, predict.channels_last)

    def postprocess(self, raw: torch.Tensor) -> torch.Tensor:
        """The heatmaps' probabilities, in fp32 (their peaks are decoded per scene: :meth:`rank_output`)."""
        return torch.sigmoid(raw.float())

    def blended_bands(self, model_cfg: PointsConfig | ModelCard) -> Sequence[str]:
        return model_cfg.labels

    def tiles_to_predict(self, scene: PredictScene, own: Sequence[Tile]) -> list[Tile]:
        """Only the rank's own tiles: each keeps the points of its core, which the tiles' cores cover."""
        return list(own)

    def rank_output(
        self,
        scene: PredictScene,
        own: Sequence[Tile],
        predicted: Sequence[Tile],
        path: str | Path,
        model_cfg: PointsConfig | ModelCard,
        settings: Settings,
        parts: Sequence[Part] | None = None,
        device: torch.device | None = None,
    ) -> RankOutput:
        rule = peak_rule(model_cfg, settings, (abs(scene.transform.a) + abs(scene.transform.e)) / 2)
        return PointsRankOutput(scene, model_cfg.labels, path, parts or (), rule, self.cores_of(scene))
