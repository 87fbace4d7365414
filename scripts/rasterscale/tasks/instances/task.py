"""Instances: tree crowns as polygons with torchvision's Mask R-CNN (DeepForest's polygon model), one polygon layer
per scene.

The instance model's library lives beside this module, in this folder (the roles of tasks/README.md): ``model``
and ``modelfiles`` (building, model files, DeepForest's folder), ``groundtruth`` and ``dataset`` (crowns as Mask
R-CNN targets), ``polygons`` and ``rankoutput`` (a tile's masks as polygons, a rank's output), ``merge`` (the
cross-tile merge by mask IoU), ``metrics`` (precision, recall, F1 and AP at mask IoU 0.5). What it shares with
detection is :mod:`rasterscale.tasks.detectors`'. This module is what the core asks of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.tasks.api import SizedDataset, model_device
from rasterscale.tasks.detectors.metrics import greedy_match, precision_recall_f1
from rasterscale.tasks.detectors.task import DetectorModel, DetectorTask
from rasterscale.tasks.instances.batched import BatchInstances, MaskLogits, instances_of, pasted_instances
from rasterscale.tasks.instances.dataset import InstanceTileDataset
from rasterscale.tasks.instances.groundtruth import GroundTruth, read_ground_truth
from rasterscale.tasks.instances.model import (
    InstanceSegmenter,
    build_instance_model,
    init_from_model_file,
    load_instance_model,
    predict_instances,
    save_instance_model,
)
from rasterscale.tasks.instances.modelfiles import instances_of_config, write_deepforest_maskrcnn_folder
from rasterscale.tasks.instances.rankoutput import InstanceRankOutput
from rasterscale.tasks.instances.spec import INSTANCES

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
    was_training, device = segmenter.training, model_device(segmenter)
    segmenter.eval()
    matched = predicted = true = 0
    for dataset in datasets:
        for start in range(0, len(dataset), batch_size):
            indexes = range(start, min(len(dataset), start + batch_size))
            outputs = predict_instances(segmenter, [dataset[i][0].to(device) for i in indexes])
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
    detector = DetectorModel(
        network="Mask R-CNN",
        called="the instance model",
        deepforest_class="MaskRCNN",
        of_config=instances_of_config,
        build=build_instance_model,
        load=load_instance_model,
        init_from_file=init_from_model_file,
        save=save_instance_model,
        write_folder=write_deepforest_maskrcnn_folder,
    )
    rank_output_class = InstanceRankOutput

    read_truth = staticmethod(read_ground_truth)

    def tile_samples(
        self, raster: str, truth: GroundTruth, spec: ImageSpec, min_visible_fraction: float
    ) -> Callable[[Sequence[Tile]], InstanceTileDataset]:
        return lambda tiles: InstanceTileDataset(raster, tiles, spec, truth, min_visible_fraction)

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_instances(model, datasets, batch_size)  # type: ignore[arg-type]

    def forward(self, model: torch.nn.Module, images: torch.Tensor) -> MaskLogits:
        """The segmenter's network over the batch as one tensor: proposals, boxes and mask logits selected for the
        whole batch at once (:mod:`rasterscale.tasks.instances.batched`)."""
        return instances_of(cast("InstanceSegmenter", model), images)

    def postprocess(self, raw: MaskLogits) -> BatchInstances:
        """The batch's instances in tile pixels, their masks pasted into their tiles and thresholded, on the
        device."""
        return pasted_instances(raw)
