"""The instance model: torchvision's Mask R-CNN on a ResNet-FPN backbone, built without any download.

resnet50 with a 256-channel pyramid is torchvision's ``maskrcnn_resnet50_fpn`` layout exactly, and so DeepForest's
Mask R-CNN: its weights load strictly. A lighter model for CPUs takes a smaller ResNet (resnet18, resnet34) and
a narrower pyramid (``fpn_channels``, e.g. 128): the region proposal head, the box head (``BOX_HEAD_WIDTH`` x
``fpn_channels`` features, torchvision's 1024 for 256) and the mask head (``MASK_HEAD_LAYERS`` convolutions) are
all as wide as the pyramid.

Labels are 0-based outside the network, as in DeepForest: :class:`InstanceSegmenter` adds torchvision's
background class (+1) to training targets and takes it off (-1) its detections, so ``model(images, targets)``
takes rasterscale's labels and returns the loss dict, and ``model(images)`` in eval mode returns 0-based labels.

The input scale travels with the model (``InstanceConfig.resize``), as the detector's: native for rasterscale's
own models, torchvision's ``min_size=800, max_size=1333`` for DeepForest's. Boxes and masks come back in tile
pixels either way (torchvision pastes each 28 x 28 mask into the tile).

Model files (formats, headers, the effective configuration) are :mod:`rasterscale.tasks.instances.modelfiles`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

from rasterscale.errors import InputError
from rasterscale.runtime.precision import float32_conv, float32_linear
from rasterscale.settings import Settings
from rasterscale.tasks.detectors.batching import tile_rows
from rasterscale.tasks.detectors.model import PatchTransform, adapt_backbone_input, load_weights, resnet_fpn
from rasterscale.tasks.inputlayer import and_then
from rasterscale.tasks.instances.batched import BatchInstances
from rasterscale.tasks.instances.modelfiles import (
    BOX_HEAD_WIDTH,
    CLASS_LAYERS,
    INSTANCES_FORMAT,
    MASK_HEAD_LAYERS,
    TASK,
    InstanceConfig,
    read_model_file,
    resolve_instances,
)
from rasterscale.tasks.modelfiles import save_payload

__all__ = [
    "InstanceConfig",
    "InstanceSegmenter",
    "build_instance_model",
    "instances_on_device",
    "instances_to_host",
    "load_instance_model",
    "predict_instances",
    "save_instance_model",
]

RETURNED_LAYERS = (1, 2, 3, 4)  # ResNet stages feeding the pyramid (P2-P5, a max-pooled P6 above), torchvision's
ROI_SIZE = 7  # torchvision's box RoIAlign output (the box head's input is fpn_channels x 7 x 7)

# Region proposals sampled per tile to train the box and mask heads (torchvision: 512, for COCO's 800-1333 px
# images of up to 100 objects): a tile of crowns holds tens, and the mask head's cost grows with the positives
# sampled (a quarter of these at most); 128 trains 2.4x faster than 512 on a 256 px tile (CPU).
ROIS_PER_TILE = 128


def shift_targets(targets: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Training targets with torchvision's labels: rasterscale's 0-based ``labels`` + 1 (class 0 is torchvision's
    background). The other keys (``boxes`` in tile pixels, ``masks`` (N, H, W) uint8) are passed as they are."""
    return [{**target, "labels": target["labels"] + 1} for target in targets]


class InstanceSegmenter(MaskRCNN):
    """torchvision's Mask R-CNN with 0-based labels outside, as DeepForest's Mask R-CNN: in training
    ``model(images, targets)`` takes rasterscale's labels (:func:`shift_targets`) and returns torchvision's
    loss dict (``loss_classifier``, ``loss_box_reg``, ``loss_mask``, ``loss_objectness``, ``loss_rpn_box_reg``);
    in eval mode ``model(images)`` returns torchvision's detections with 0-based labels. ``mask_threshold``: the
    probability from which a mask pixel is the instance's (:func:`predict_instances`)."""

    mask_threshold: float = 0.5

    def forward(self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]] | None = None) -> Any:
        if self.training and targets is not None:
            targets = shift_targets(targets)
        out = super().forward(images, targets)
        if self.training:
            return out
        return [{**detections, "labels": detections["labels"] - 1} for detections in out]


def build_instance_model(cfg: InstanceConfig) -> InstanceSegmenter:
    """torchvision's ``maskrcnn_resnet50_fpn`` architecture (DeepForest's Mask R-CNN) on any ResNet depth, with a
    feature pyramid of ``cfg.fpn_channels`` channels and heads as wide (256: torchvision's exactly; fewer: a lighter
    model). Random weights; class 0 is torchvision's background, ``cfg.labels`` are classes 1.."""
    width = cfg.fpn_channels
    model = InstanceSegmenter(
        resnet_fpn(cfg.backbone, RETURNED_LAYERS, width, bands=cfg.input.count),  # extra block: max-pooled P6
        num_classes=None,  # the predictors below say it
        image_mean=list(cfg.input.mean),
        image_std=list(cfg.input.std),
        box_head=TwoMLPHead(width * ROI_SIZE**2, BOX_HEAD_WIDTH * width),
        box_predictor=FastRCNNPredictor(BOX_HEAD_WIDTH * width, cfg.num_classes),
        mask_head=MaskRCNNHeads(width, [width] * MASK_HEAD_LAYERS, 1),
        mask_predictor=MaskRCNNPredictor(width, width, cfg.num_classes),
        box_score_thresh=cfg.score_threshold,
        box_nms_thresh=cfg.nms_threshold,
        box_detections_per_img=cfg.detections_per_tile,
        box_batch_size_per_image=ROIS_PER_TILE,
    )
    model.transform = PatchTransform(cfg.patch_size, cfg.resize, cfg.input)
    model.mask_threshold = cfg.mask_threshold
    # output layers in fp32 under autocast (the box predictor's too: torchvision decodes boxes in the dtype of their
    # regressions, 4 px steps at 800 px in bf16, and the masks are placed and sized by those boxes)
    rpn, masks, boxes = model.rpn.head, model.roi_heads.mask_predictor, model.roi_heads.box_predictor
    rpn.cls_logits, rpn.bbox_pred = float32_conv(rpn.cls_logits), float32_conv(rpn.bbox_pred)
    masks.mask_fcn_logits = float32_conv(masks.mask_fcn_logits)
    boxes.cls_score, boxes.bbox_pred = float32_linear(boxes.cls_score), float32_linear(boxes.bbox_pred)
    return model


def save_instance_model(model: torch.nn.Module, cfg: InstanceConfig, path: str | Path, **meta: Any) -> None:
    """A rasterscale instance model file: ``{"format": INSTANCES_FORMAT, "task": "instances", "model":
    cfg.to_dict(), "state_dict", "meta": meta}``, written atomically."""
    save_payload(path, INSTANCES_FORMAT, cfg.to_dict(), model, task=TASK, meta=meta)


def load_instance_model(
    path: str | Path, settings: Settings | None = None
) -> tuple[InstanceSegmenter, InstanceConfig, dict[str, Any]]:
    """The instance model of a model file (a rasterscale ``.pt`` file or a DeepForest Mask R-CNN folder), built
    with the effective configuration: what the file says, overridden by every ``model.*`` key set in ``settings`` (a
    validated config's; None: the file's alone), its weights loaded strictly. Returns the model, its configuration
    and the file's metadata (training figures of rasterscale's)."""
    header, state = read_model_file(path)
    cfg = resolve_instances(settings, header)
    model = build_instance_model(cfg)
    load_weights(model, state, path, what="the instance model")
    return model, cfg, header.meta


def init_from_model_file(model: InstanceSegmenter, cfg: InstanceConfig, path: str | Path) -> str:
    """Start ``model`` (just built from ``cfg``) from a model file's weights. When ``cfg.labels`` are other classes
    than the file's, the layers whose shape depends on the classes (the box predictor's class scores and box
    deltas, the mask predictor's logits) keep their fresh initialization; otherwise every weight loads. Returns
    what was loaded, for the log."""
    header, state = read_model_file(path)
    if (header.backbone, header.fpn_channels) != (cfg.backbone, cfg.fpn_channels):
        raise InputError(
            f"{path}: a {header.backbone} model with a {header.fpn_channels}-channel pyramid, but the model to "
            f"train is a {cfg.backbone} with {cfg.fpn_channels}"
        )
    keep_head = header.keeps_class_head(cfg.labels)
    state, adapted = adapt_backbone_input(state, cfg.input, header.input)
    load_weights(model, state, path, skip=() if keep_head else CLASS_LAYERS, what="the instance model")
    if keep_head:
        return f"all weights from {header.describe()}{and_then(adapted)}"
    return (
        f"weights from {header.describe()}, except the box and mask predictors' class layers, new for "
        f"{len(cfg.labels)} class(es) {', '.join(cfg.labels)}{and_then(adapted)}"
    )


def predict_instances(
    model: InstanceSegmenter, images: list[torch.Tensor], probabilities: bool = False
) -> list[dict[str, np.ndarray]]:
    """Instances of each tile (``images``: float (3, H, W) in [0, 1], on the model's device; the model in eval
    mode), as numpy arrays: ``boxes`` (N, 4) float32 in tile pixels (xmin, ymin, xmax, ymax), ``scores`` (N,)
    float32, ``labels`` (N,) int64 0-based, and ``masks`` (N, H, W) at the tile's size: uint8 0/1, a pixel being
    the instance's where its probability is at least the model's ``mask_threshold`` (thresholded on the device, 4x
    less to copy); with ``probabilities``, the float32 probabilities instead; ``origins`` (N, 2) zeros (the masks
    are whole tiles, not crops)."""
    if model.training:
        raise ValueError("predict_instances needs the model in eval mode")
    with torch.inference_mode():
        found = instances_on_device(model(images), model.mask_threshold, probabilities)
    return instances_to_host(found)


def instances_on_device(
    outputs: list[dict[str, torch.Tensor]], threshold: float, probabilities: bool = False
) -> BatchInstances:
    """torchvision's instances of a batch (each tile's ``boxes``, ``scores``, ``labels``, ``masks`` (N, 1, H, W)) as
    one tensor per kind, still on the device, the masks thresholded at ``threshold`` into uint8 0/1 (or, with
    ``probabilities``, float32), each the whole tile's (origins at 0, 0)."""
    masks = torch.cat([out["masks"][:, 0] for out in outputs])
    masks = masks.float() if probabilities else (masks >= threshold).to(torch.uint8)
    device = masks.device
    tiles = torch.cat([torch.full((len(out["scores"]),), k, device=device) for k, out in enumerate(outputs)])
    return BatchInstances(
        tiles=tiles,
        count=len(outputs),
        boxes=torch.cat([out["boxes"] for out in outputs]).float(),
        scores=torch.cat([out["scores"] for out in outputs]).float(),
        labels=torch.cat([out["labels"] for out in outputs]),
        masks=masks,
        origins=torch.zeros((len(masks), 2), dtype=torch.int64, device=device),
    )


def instances_to_host(found: BatchInstances) -> list[dict[str, np.ndarray]]:
    """A batch's instances as numpy arrays, tile by tile, in two copies for the batch: the boxes, scores, labels,
    origins and tiles packed in one (:meth:`~.batched.BatchInstances.packed`), and the masks (the crops of their
    tiles from their ``origins``)."""
    packed, masks = found.packed().cpu().numpy(), found.masks.cpu().numpy()
    host = {
        "boxes": packed[:, :4],
        "scores": packed[:, 4],
        "labels": packed[:, 5].astype(np.int64),
        "masks": masks,
        "origins": packed[:, 6:8].astype(np.int64),
    }
    return [{key: values[a:b] for key, values in host.items()} for a, b in tile_rows(packed[:, 8], found.count)]
