"""Instances: tree crowns as polygons with torchvision's Mask R-CNN (DeepForest's polygon model), one polygon layer
per scene.

The instance model's library lives beside this module, in this folder: ``model`` and ``modelfiles`` (building,
model files, DeepForest's folder), ``groundtruth`` and ``dataset`` (crowns as Mask R-CNN targets), ``polygons``
and ``rankoutput`` (a tile's masks as polygons, a rank's output), ``merge`` (the cross-tile merge by mask IoU),
``evaluate`` (precision, recall, F1 and AP at mask IoU 0.5). This module is what the core asks of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from rasterscale.datasets.sampling import FlippableSamples
from rasterscale.grid.tile import Tile
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import ImageSpec
from rasterscale.scene import Scene
from rasterscale.tasks.api import PredictScene, RankOutput, SizedDataset
from rasterscale.tasks.detectors import DetectorTask
from rasterscale.tasks.instances.dataset import InstanceTileDataset
from rasterscale.tasks.instances.groundtruth import read_ground_truth
from rasterscale.tasks.instances.model import (
    InstanceSegmenter,
    build_instance_model,
    init_from_model_file,
    load_instance_model,
    predict_instances,
    save_instance_model,
)
from rasterscale.tasks.instances.modelfiles import (
    InstanceConfig,
    instances_of_config,
    write_deepforest_maskrcnn_folder,
)
from rasterscale.tasks.instances.rankoutput import InstanceRankOutput
from rasterscale.tasks.instances.spec import INSTANCES
from rasterscale.tasks.objects import greedy_match, precision_recall_f1
from rasterscale.tasks.spec import Part

VALIDATION_IOU = 0.5  # mask IoU of a match in the validation scores


def mask_ious(predicted: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """IoU of every predicted mask with every true mask of a tile, (N, H, W) and (M, H, W) 0/1 arrays: (N, M)."""
    if len(predicted) == 0 or len(truth) == 0:
        return np.zeros((len(predicted), len(truth)))
    p = predicted.reshape(len(predicted), -1).astype(np.float32)
    t = truth.reshape(len(truth), -1).astype(np.float32)
    inter = p @ t.T
    union = p.sum(1)[:, None] + t.sum(1)[None, :] - inter
    return inter / np.maximum(union, 1.0)


def validate_instances(
    model: torch.nn.Module, datasets: Sequence[InstanceTileDataset], batch_size: int
) -> dict[str, float]:
    """Tile-level precision, recall and F1 at mask IoU 0.5 on the validation tiles (rank 0 only)."""
    segmenter = cast("InstanceSegmenter", model)
    was_training = segmenter.training
    segmenter.eval()
    matched = predicted = true = 0
    for dataset in datasets:
        for start in range(0, len(dataset), batch_size):
            indexes = range(start, min(len(dataset), start + batch_size))
            outputs = predict_instances(segmenter, [dataset[i][0] for i in indexes])
            for index, out in zip(indexes, outputs, strict=True):
                target = dataset.target(index)
                truth, labels = target["masks"].numpy(), target["labels"].numpy()
                ious = mask_ious(out["masks"], truth)
                pred_idx, gt_idx = np.nonzero((ious > 0) & (out["labels"][:, None] == labels[None, :]))
                match = greedy_match(
                    pred_idx, gt_idx, ious[pred_idx, gt_idx], out["scores"], len(truth), VALIDATION_IOU
                )
                matched += int((match >= 0).sum())
                predicted, true = predicted + len(out["masks"]), true + len(truth)
    segmenter.train(was_training)
    precision, recall, f1 = precision_recall_f1(matched, predicted, true)
    return {"val_precision": precision, "val_recall": recall, "val_f1": f1}


class InstancesTask(DetectorTask):
    spec = INSTANCES
    deepforest_class = "MaskRCNN"
    model_name = "the instance model"

    def model_config(self, config: Mapping[str, Any]) -> InstanceConfig:
        return instances_of_config(config)[0]

    def describe(self, model_cfg: InstanceConfig) -> str:
        return f"Mask R-CNN {model_cfg.backbone}, {model_cfg.describe()}"

    def load_model(self, path: str | Path, config: Mapping[str, Any]) -> tuple[torch.nn.Module, InstanceConfig]:
        model, cfg, _ = load_instance_model(path, config)
        return model, cfg

    def build_model(self, model_cfg: InstanceConfig) -> torch.nn.Module:
        return build_instance_model(model_cfg)

    def init_from_model_file(self, model: torch.nn.Module, model_cfg: InstanceConfig, path: str | Path) -> str:
        return init_from_model_file(cast("InstanceSegmenter", model), model_cfg, path)

    def write_model_files(
        self, model: torch.nn.Module, model_cfg: InstanceConfig, model_path: Path, folder: Path, **meta: Any
    ) -> None:
        save_instance_model(model, model_cfg, model_path, **meta)
        write_deepforest_maskrcnn_folder(model.state_dict(), model_cfg, folder)

    def training_datasets(
        self,
        scene: Scene,
        model_cfg: InstanceConfig,
        train: Sequence[Tile],
        validation: Sequence[Tile],
        spec: ImageSpec,
        train_cfg: Mapping[str, Any],
    ) -> tuple[FlippableSamples, SizedDataset | None]:
        raster = check_raster(scene.raster)
        labels = list(model_cfg.labels)
        truth = read_ground_truth(scene.annotations, raster, labels, scene.label_column, scene.image_path)
        fraction = train_cfg["min_visible_fraction"]
        train_set = InstanceTileDataset(scene.raster, train, spec, truth, fraction)
        val_set = InstanceTileDataset(scene.raster, validation, spec, truth, fraction) if validation else None
        return train_set, val_set

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_instances(model, datasets, batch_size)  # type: ignore[arg-type]

    def predict_batch(self, model: torch.nn.Module, images: list[torch.Tensor]) -> list[dict[str, np.ndarray]]:
        return predict_instances(cast("InstanceSegmenter", model), images)

    def rank_output(
        self,
        scene: PredictScene,
        own: Sequence[Tile],
        predicted: Sequence[Tile],
        path: str | Path,
        model_cfg: InstanceConfig,
        config: Mapping[str, Any],
        parts: Sequence[Part] | None = None,
    ) -> RankOutput:
        return InstanceRankOutput(scene, model_cfg.labels, path, parts or (), model_cfg.mask_threshold)
