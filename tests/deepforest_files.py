"""Model files in DeepForest's formats, written here the way DeepForest 2.1.0 writes them (checked against the
real thing by bench/deepforest/test_interop.py in DeepForest's own environment): tiny torchvision RetinaNets."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchvision.models import resnet
from torchvision.models.detection import RetinaNet
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

TREE = {"Tree": 0}


def torchvision_retinanet(num_classes: int = 1, backbone: str = "resnet18", seed: int = 0, **kwargs) -> RetinaNet:
    """Plain torchvision RetinaNet as DeepForest builds it (ResNet-FPN, P6/P7 from P5's 256 channels, default
    anchors and transform: min_size 800, max_size 1333), random weights."""
    torch.manual_seed(seed)
    body = getattr(resnet, backbone)(weights=None)
    features = _resnet_fpn_extractor(body, 5, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))
    return RetinaNet(features, num_classes=num_classes, **kwargs).eval()


def released_state_dict(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The weights as DeepForest's released files hold them: trained with frozen batch norms, so without the
    norms' step counters; older releases prefix every key with ``model.``."""
    return {prefix + k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def write_folder(
    folder: Path,
    model: torch.nn.Module,
    label_dict: dict[str, int] | None = None,
    score_thresh: float = 0.5,
    nms_thresh: float = 0.05,
    prefix: str = "",
) -> Path:
    """``RetinaNetHub.save_pretrained``'s layout: config.json + model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    label_dict = label_dict or TREE
    config = {"label_dict": label_dict, "nms_thresh": nms_thresh, "num_classes": len(label_dict)}
    config["score_thresh"] = score_thresh
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(released_state_dict(model, prefix), str(folder / "model.safetensors"))
    return folder


def write_lightning_checkpoint(path: Path, model: torch.nn.Module, label_dict: dict[str, int] | None = None) -> Path:
    """A DeepForest Lightning ``.ckpt`` (``deepforest.main.deepforest.save_model``): the detector is the
    module's ``model``; label_dict at the top level and in the hyper-parameters' config."""
    label_dict = label_dict or TREE
    config = {"label_dict": label_dict, "num_classes": len(label_dict), "score_thresh": 0.1, "nms_thresh": 0.05}
    payload = {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hparams_name": "kwargs",
        "hyper_parameters": {"config": {**config, "patch_size": 400, "architecture": "retinanet"}},
        "label_dict": label_dict,
        "numeric_to_label_dict": {v: k for k, v in label_dict.items()},
    }
    torch.save(payload, path)
    return path
