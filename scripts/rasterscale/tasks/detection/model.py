"""The detector: torchvision RetinaNet on a ResNet-FPN backbone, built without any download.

resnet50 is DeepForest's architecture. The input scale travels with the model (``DetectorConfig.resize``):
rasterscale's own models see tiles at their native ground sample distance (torchvision's default would resize
every tile to 800 px, 4x the compute for 400 px tiles); DeepForest's models were trained through torchvision's
``min_size=800, max_size=1333`` resize and get it. Either way the resize runs inside the model, on the device,
after the uint8 tile has been copied there, and boxes come back in tile pixels.

Model files (formats, headers, the effective configuration) are :mod:`rasterscale.tasks.detection.modelfiles`' business.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torchvision.models.detection import RetinaNet
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from rasterscale.errors import InputError
from rasterscale.runtime.precision import float32_conv
from rasterscale.settings import Settings
from rasterscale.tasks.detection.modelfiles import (
    CLASS_LOGITS,
    DETECTOR_FORMAT,
    DetectorConfig,
    read_model_file,
    resolve_detector,
)
from rasterscale.tasks.detectors.model import PatchTransform, adapt_backbone_input, load_weights, resnet_fpn
from rasterscale.tasks.inputlayer import and_then
from rasterscale.tasks.modelfiles import save_payload

__all__ = ["DetectorConfig", "build_detector", "load_detector", "save_detector"]


RETURNED_LAYERS = (2, 3, 4)  # ResNet stages feeding the pyramid (P3-P5; P6, P7 above them), as torchvision's


def build_detector(cfg: DetectorConfig) -> RetinaNet:
    """torchvision's ``retinanet_resnet50_fpn`` architecture (DeepForest's), on any ResNet depth and with a feature
    pyramid of ``cfg.fpn_channels`` channels (256: torchvision's; fewer: a lighter pyramid and head)."""
    width = cfg.fpn_channels
    features = resnet_fpn(cfg.backbone, RETURNED_LAYERS, width, lambda: LastLevelP6P7(width, width), cfg.input.count)
    model = RetinaNet(
        features,
        num_classes=len(cfg.labels),
        image_mean=list(cfg.input.mean),
        image_std=list(cfg.input.std),
        score_thresh=cfg.score_threshold,
        nms_thresh=cfg.nms_threshold,
        detections_per_img=cfg.detections_per_tile,
    )
    model.transform = PatchTransform(cfg.patch_size, cfg.resize, cfg.input)
    head = model.head  # its output layers in fp32 under autocast (rasterscale.runtime.precision)
    head.classification_head.cls_logits = float32_conv(head.classification_head.cls_logits)
    head.regression_head.bbox_reg = float32_conv(head.regression_head.bbox_reg)
    return model


def save_detector(model: torch.nn.Module, cfg: DetectorConfig, path: str | Path, **meta: Any) -> None:
    save_payload(path, DETECTOR_FORMAT, cfg.to_dict(), model, task="detection", meta=meta)


def load_detector(
    path: str | Path, settings: Settings | None = None
) -> tuple[RetinaNet, DetectorConfig, dict[str, Any]]:
    """The detector of any model file rasterscale reads (:mod:`rasterscale.tasks.detection.modelfiles`), built with the
    effective configuration: what the file says, overridden by every ``model.*`` key set in ``settings`` (a validated
    config's; None: the file's alone). Returns the model, its configuration and the file's metadata (training
    figures of rasterscale's)."""
    header, state = read_model_file(path)
    cfg = resolve_detector(settings, header)
    model = build_detector(cfg)
    load_weights(model, state, path)
    return model, cfg, header.meta


def reset_class_logits(model: RetinaNet) -> None:
    """A fresh last layer of the classification head, initialized as torchvision initializes it."""
    layer = model.head.classification_head.cls_logits
    torch.nn.init.normal_(layer.weight, std=0.01)
    torch.nn.init.constant_(layer.bias, -math.log((1 - 0.01) / 0.01))


def init_from_model_file(model: RetinaNet, cfg: DetectorConfig, path: str | Path) -> str:
    """Start ``model`` (built from ``cfg``) from a model file's weights. When ``cfg.labels`` are other classes
    than the file's, the classification head's last layer starts afresh; otherwise every weight loads. Returns
    what was loaded, for the log."""
    header, state = read_model_file(path)
    if header.backbone != cfg.backbone:
        raise InputError(f"{path}: a {header.backbone} model, but the detector to train is a {cfg.backbone}")
    keep_head = header.keeps_class_head(cfg.labels)
    state, adapted = adapt_backbone_input(state, cfg.input, header.input)
    load_weights(model, state, path, skip="" if keep_head else CLASS_LOGITS)
    if keep_head:
        return f"all weights from {header.describe()}{and_then(adapted)}"
    reset_class_logits(model)
    return (
        f"weights from {header.describe()}, except the class head's last layer, new for "
        f"{len(cfg.labels)} class(es) {', '.join(cfg.labels)}{and_then(adapted)}"
    )
