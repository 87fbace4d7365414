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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torchvision.models import resnet
from torchvision.models.detection import RetinaNet
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.feature_pyramid_network import LastLevelP6P7
from torchvision.ops.misc import FrozenBatchNorm2d

from rasterscale.errors import InputError
from rasterscale.raster.imagery import IMAGE_MEAN, IMAGE_STD
from rasterscale.runtime.precision import float32_conv
from rasterscale.tasks.detection.modelfiles import (
    CLASS_LOGITS,
    DETECTOR_FORMAT,
    DetectorConfig,
    ModelHeader,
    read_model_file,
    resolve_detector,
    same_classes,
)
from rasterscale.tasks.modelfiles import save_payload

__all__ = ["DetectorConfig", "build_detector", "load_detector", "save_detector"]


class PatchTransform(GeneralizedRCNNTransform):
    """Normalizes and batches tiles; resizes them only when the model records a resize ``(min_size, max_size)``
    (torchvision's own resize, boxes mapped back to tile pixels by ``postprocess``). Without one, tiles keep
    their own size and boxes stay in tile pixels."""

    def __init__(self, patch_size: int, resize: tuple[int, int] | None = None) -> None:
        min_size, max_size = resize or (patch_size, patch_size)
        super().__init__(min_size, max_size, list(IMAGE_MEAN), list(IMAGE_STD))
        self.native = resize is None

    def resize(self, image: torch.Tensor, target: dict[str, torch.Tensor] | None = None) -> tuple:
        if self.native:
            return image, target
        return super().resize(image, target)


RETURNED_LAYERS = (2, 3, 4)  # ResNet stages feeding the pyramid (P3-P5; P6, P7 above them), as torchvision's


def build_detector(cfg: DetectorConfig) -> RetinaNet:
    """torchvision's ``retinanet_resnet50_fpn`` architecture (DeepForest's), on any ResNet depth and with a feature
    pyramid of ``cfg.fpn_channels`` channels (256: torchvision's; fewer: a lighter pyramid and head)."""
    backbone = getattr(resnet, cfg.backbone)(weights=None)
    width = backbone.inplanes // 8  # channels of layer1's output
    features = BackboneWithFPN(
        backbone,
        {f"layer{k}": str(v) for v, k in enumerate(RETURNED_LAYERS)},
        [width * 2 ** (k - 1) for k in RETURNED_LAYERS],
        cfg.fpn_channels,
        extra_blocks=LastLevelP6P7(cfg.fpn_channels, cfg.fpn_channels),
    )
    model = RetinaNet(
        features,
        num_classes=len(cfg.labels),
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
        score_thresh=cfg.score_threshold,
        nms_thresh=cfg.nms_threshold,
        detections_per_img=cfg.detections_per_tile,
    )
    model.transform = PatchTransform(cfg.patch_size, cfg.resize)
    head = model.head  # its output layers in fp32 under autocast (rasterscale.runtime.precision)
    head.classification_head.cls_logits = float32_conv(head.classification_head.cls_logits)
    head.regression_head.bbox_reg = float32_conv(head.regression_head.bbox_reg)
    return model


def save_detector(model: torch.nn.Module, cfg: DetectorConfig, path: str | Path, **meta: Any) -> None:
    save_payload(path, DETECTOR_FORMAT, cfg.to_dict(), model, task="detection", meta=meta)


def load_weights(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    path: str | Path,
    skip: str = "",
    what: str = "the detector",
) -> None:
    """Load a file's weights into ``module`` (the detector, or its backbone's ResNet: ``what``), strictly except
    for batch-norm step counters (DeepForest's weights, trained with frozen batch norms, have none) and the keys
    starting with ``skip`` (left as initialized)."""
    state = {k: v for k, v in state_dict.items() if not (skip and k.startswith(skip))}
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes that do not fit
        raise InputError(f"{path}: weights do not fit {what} ({str(err).splitlines()[1].strip()[:160]})") from None
    missing = [
        k for k in result.missing_keys if not k.endswith("num_batches_tracked") and not (skip and k.startswith(skip))
    ]
    if missing or result.unexpected_keys:
        keys = (missing or result.unexpected_keys)[:3]
        problem = "lacks" if missing else "has unexpected"
        raise InputError(f"{path}: weights do not fit {what}: {problem} {', '.join(keys)}")


def load_detector(
    path: str | Path, config: Mapping[str, Any] | None = None
) -> tuple[RetinaNet, DetectorConfig, dict[str, Any]]:
    """The detector of any model file rasterscale reads (:mod:`rasterscale.tasks.detection.modelfiles`), built with the
    effective configuration: what the file says, overridden by every ``model.*`` key set in ``config`` (a validated
    config). Returns the model, its configuration and the file's metadata (training figures of rasterscale's)."""
    header, state = read_model_file(path)
    cfg = resolve_detector(config or {}, header)
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
    keep_head = header.num_classes == len(cfg.labels) and (
        header.labels is None or same_classes(header.labels, cfg.labels)
    )
    load_weights(model, state, path, skip="" if keep_head else CLASS_LOGITS)
    if keep_head:
        return f"all weights from {describe_header(header)}"
    reset_class_logits(model)
    return (
        f"weights from {describe_header(header)}, except the class head's last layer, new for "
        f"{len(cfg.labels)} class(es) {', '.join(cfg.labels)}"
    )


def describe_header(header: ModelHeader) -> str:
    labels = ", ".join(header.labels) if header.labels else f"{header.num_classes} unnamed class(es)"
    return f"{header.path} ({header.kind}, {header.backbone}, {labels})"


def load_backbone_weights(model: RetinaNet, path: str | Path) -> str:
    """Start the backbone's ResNet from a torchvision ImageNet state dict (its ``fc.`` classifier ignored)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is the user's to fix
        raise InputError(f"{path}: not a torch state dict ({str(err).splitlines()[0][:120]})") from None
    if not isinstance(state, Mapping) or "conv1.weight" not in state:
        raise InputError(f"{path}: not a torchvision ResNet state dict (model.backbone_weights)")
    body = {k: v for k, v in state.items() if not k.startswith("fc.")}
    load_weights(model.backbone.body, body, path, what="the detector's backbone")
    return f"backbone from the ImageNet weights {path} ({len(body)} tensors)"


FROZEN_STEM = ("conv1", "layer1")  # what torchvision (and so DeepForest) keeps fixed in a pretrained backbone


def has_trained_statistics(model: RetinaNet) -> bool:
    """Whether the backbone's batch norms hold statistics estimated on data: a model that was never trained keeps
    their initial mean 0 and variance 1, and freezing those would only fix an untrained stem."""
    norms = [m for m in model.backbone.body.modules() if isinstance(m, torch.nn.BatchNorm2d | FrozenBatchNorm2d)]
    return any(_estimated(m) for m in norms)


def _estimated(norm: torch.nn.BatchNorm2d | FrozenBatchNorm2d) -> bool:
    """Whether a batch norm's running statistics moved from their initial mean 0 and variance 1."""
    mean, var = norm.running_mean, norm.running_var
    assert mean is not None and var is not None  # a ResNet's batch norms track running statistics
    return bool((mean != 0).any() or (var != 1).any())


def freeze_pretrained_backbone(model: RetinaNet) -> str:
    """Fine-tune a pretrained backbone as torchvision and DeepForest do: its batch norms frozen (their ImageNet or
    DeepForest statistics kept, not re-estimated from small batches) and its stem (conv1, layer1) fixed. A
    backbone whose batch norms were never trained (:func:`has_trained_statistics`) is left to train whole."""
    if not has_trained_statistics(model):
        return "backbone batch norms hold no trained statistics (an untrained model): the whole backbone trains"
    body = model.backbone.body
    frozen = 0
    for parent in list(body.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.BatchNorm2d):
                norm = FrozenBatchNorm2d(child.num_features, eps=child.eps)
                for key in ("weight", "bias", "running_mean", "running_var"):
                    getattr(norm, key).copy_(getattr(child, key).detach())
                setattr(parent, name, norm)
                frozen += 1
    for name, parameter in body.named_parameters():
        if name.startswith(FROZEN_STEM):
            parameter.requires_grad_(False)
    return f"backbone batch norms frozen ({frozen}), {' and '.join(FROZEN_STEM)} fixed"
