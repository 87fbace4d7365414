"""The detector: torchvision RetinaNet on a ResNet-FPN backbone, built without any download.

resnet50 is DeepForest's architecture. The input transform is sized to the patch and never resamples:
torchvision's default resizes every tile to 800 px, which silently changes the ground sample distance the
model sees (and costs 4x the compute for 400 px tiles).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchvision.models import resnet
from torchvision.models.detection import RetinaNet
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

CHECKPOINT_FORMAT = "rasterscale-detector/1"
# ImageNet statistics, as DeepForest and torchvision use them.
IMAGE_MEAN = [0.485, 0.456, 0.406]
IMAGE_STD = [0.229, 0.224, 0.225]


@dataclass(frozen=True)
class DetectorConfig:
    backbone: str = "resnet50"
    labels: tuple[str, ...] = ("tree",)
    patch_size: int = 400
    score_threshold: float = 0.3
    nms_threshold: float = 0.4
    detections_per_tile: int = 300
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DetectorConfig:
        model = config["model"]
        return cls(
            backbone=model["backbone"],
            labels=tuple(model["labels"]),
            patch_size=config["tiling"]["patch_size"],
            score_threshold=model["score_threshold"],
            nms_threshold=model["nms_threshold"],
            detections_per_tile=model["detections_per_tile"],
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["labels"] = list(self.labels)
        return data


class PatchTransform(GeneralizedRCNNTransform):
    """Normalizes and batches tiles at their own size: no resampling, boxes stay in tile pixels."""

    def resize(self, image: torch.Tensor, target: dict[str, torch.Tensor] | None = None) -> tuple:
        return image, target


def build_detector(cfg: DetectorConfig) -> RetinaNet:
    backbone = getattr(resnet, cfg.backbone)(weights=None)
    features = _resnet_fpn_extractor(
        backbone, trainable_layers=5, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256)
    )
    model = RetinaNet(
        features,
        num_classes=len(cfg.labels),
        min_size=cfg.patch_size,
        max_size=cfg.patch_size,
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
        score_thresh=cfg.score_threshold,
        nms_thresh=cfg.nms_threshold,
        detections_per_img=cfg.detections_per_tile,
    )
    model.transform = PatchTransform(cfg.patch_size, cfg.patch_size, IMAGE_MEAN, IMAGE_STD)
    return model


def save_checkpoint(model: torch.nn.Module, cfg: DetectorConfig, path: str | Path, **meta: Any) -> None:
    from rasterscale.outputs import atomic_path

    payload = {
        "format": CHECKPOINT_FORMAT,
        "model": cfg.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "meta": meta,
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_checkpoint(path: str | Path) -> tuple[RetinaNet, DetectorConfig, dict[str, Any]]:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a rasterscale detector checkpoint (format {CHECKPOINT_FORMAT})")
    data = dict(payload["model"])
    data["labels"] = tuple(data["labels"])
    cfg = DetectorConfig(**data)
    model = build_detector(cfg)
    model.load_state_dict(payload["state_dict"])
    return model, cfg, payload.get("meta", {})
