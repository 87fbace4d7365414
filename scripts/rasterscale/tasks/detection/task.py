"""Detection: boxes with torchvision's RetinaNet (DeepForest's model), one vector layer per scene.

The detector's library lives beside this module, in this folder (the roles of tasks/README.md): ``model`` and
``modelfiles`` (building, model files, DeepForest's formats), ``groundtruth`` and ``dataset`` (boxes as RetinaNet's
targets), ``rankoutput`` (a rank's detections), ``merge`` (the cross-tile merge), ``metrics`` (precision, recall,
F1, mAP). What it shares with instances is :mod:`rasterscale.tasks.detectors`'. This module is what the core asks of
them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec, on_data
from rasterscale.tasks.api import SizedDataset, model_device
from rasterscale.tasks.detection.batched import BatchDetections, HeadOutputs, head_outputs, select_detections
from rasterscale.tasks.detection.dataset import TrainTileDataset
from rasterscale.tasks.detection.groundtruth import Annotations, read_annotations
from rasterscale.tasks.detection.metrics import evaluate_detections
from rasterscale.tasks.detection.model import build_detector, init_from_model_file, load_detector, save_detector
from rasterscale.tasks.detection.modelfiles import detector_of_config, write_deepforest_folder
from rasterscale.tasks.detection.rankoutput import DetectionRankOutput
from rasterscale.tasks.detection.spec import DETECTION
from rasterscale.tasks.detectors.task import DetectorModel, DetectorTask

if TYPE_CHECKING:
    from torchvision.models.detection import RetinaNet


def predict_tiles(model: torch.nn.Module, dataset: TrainTileDataset, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Run the raw detector over a tile dataset (rank 0 only: no collectives)."""
    was_training, device = model.training, model_device(model)
    model.eval()
    outputs: list[dict[str, np.ndarray]] = []
    with torch.inference_mode():
        for start in range(0, len(dataset), batch_size):
            images = [dataset[i][0].to(device) for i in range(start, min(len(dataset), start + batch_size))]
            outputs.extend({k: v.float().cpu().numpy() for k, v in o.items()} for o in model(images))
    model.train(was_training)
    return outputs


def validate_detector(
    model: torch.nn.Module, datasets: Sequence[TrainTileDataset], batch_size: int
) -> dict[str, float]:
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
        score_threshold=float(cast("RetinaNet", model).score_thresh),  # the task's model: a RetinaNet
    )
    return {f"val_{k}": float(metrics[k]) for k in ("precision", "recall", "f1", "map50")}


class DetectionTask(DetectorTask):
    spec = DETECTION
    detector = DetectorModel(
        network="RetinaNet",
        called="the detector",
        deepforest_class="RetinaNetHub",
        of_config=detector_of_config,
        build=build_detector,
        load=load_detector,
        init_from_file=init_from_model_file,
        save=save_detector,
        write_folder=write_deepforest_folder,
    )
    rank_output_class = DetectionRankOutput

    read_truth = staticmethod(read_annotations)

    def tile_samples(
        self, raster: str, truth: Annotations, spec: ImageSpec, min_visible_fraction: float
    ) -> Callable[[Sequence[Tile]], TrainTileDataset]:
        keep = on_data(raster, spec, truth.boxes)  # boxes on masked pixels: the tiles show none
        boxes, labels = truth.boxes[keep], truth.labels[keep]
        return lambda tiles: TrainTileDataset(raster, tiles, spec, boxes, labels, min_visible_fraction)

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_detector(model, datasets, batch_size)  # type: ignore[arg-type]

    def forward(self, model: torch.nn.Module, images: torch.Tensor) -> HeadOutputs:
        """The detector's network over the batch as one tensor: torchvision's transform done for the whole batch,
        backbone and heads, the anchors of its size made once (:mod:`rasterscale.tasks.detection.batched`)."""
        return head_outputs(cast("RetinaNet", model), images)

    def postprocess(self, raw: HeadOutputs) -> BatchDetections:
        """The batch's boxes, scores and labels, as torchvision's RetinaNet keeps them, selected for the whole batch
        at once, on the device."""
        return select_detections(raw)
