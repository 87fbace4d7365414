"""Model files in DeepForest's formats, written here the way DeepForest 2.1.0 writes them (checked against the
real thing by bench/deepforest/test_interop.py in DeepForest's own environment): tiny torchvision RetinaNets; and
a replica of the Mask R-CNN of DeepForest's main branch (not released in 2.1.0, so not checked against it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchvision.models import resnet
from torchvision.models.detection import MaskRCNN, RetinaNet
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
from torchvision.ops.feature_pyramid_network import LastLevelP6P7
from torchvision.ops.misc import FrozenBatchNorm2d

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


# --- DeepForest's Mask R-CNN (its main branch: deepforest.models.maskrcnn; the 2.1.0 release has none) ----------


class DeepForestMaskRCNN(MaskRCNN):
    """A replica of DeepForest's Mask R-CNN (a torchvision ``MaskRCNN`` and a huggingface ``PyTorchModelHubMixin``):
    the same ``__init__`` (config.json's keys are its arguments; other keys go to torchvision's ``MaskRCNN``), the
    same backbone and the same label shift (+1 to training targets, -1 to detections: torchvision's class 0 is
    the background). DeepForest takes the backbone of ``maskrcnn_resnet50_fpn(weights=backbone_weights)``, whose
    default ImageNet backbone makes it a ResNet-50 with frozen batch norms (so its weights have no step counters)
    and 3 trainable layers; built here the same way, without the download."""

    def __init__(
        self,
        backbone_weights=None,
        num_classes: int = 1,
        nms_thresh: float = 0.05,
        score_thresh: float = 0.5,
        label_dict: dict[str, int] | None = None,
        **kwargs,
    ):
        assert backbone_weights is None  # no machine here downloads weights
        backbone = _resnet_fpn_extractor(resnet.resnet50(weights=None, norm_layer=FrozenBatchNorm2d), 3)
        super().__init__(
            backbone=backbone,
            num_classes=num_classes + 1,
            box_nms_thresh=nms_thresh,
            box_score_thresh=score_thresh,
            **kwargs,
        )
        self.label_dict = label_dict
        self.config = {
            "num_classes": num_classes,
            "nms_thresh": nms_thresh,
            "score_thresh": score_thresh,
            "label_dict": label_dict,
            **kwargs,
        }

    def forward(self, images, targets=None):
        if self.training and targets is not None:
            targets = [{**target, "labels": target["labels"] + 1} for target in targets]
        out = super().forward(images, targets)
        if not self.training:
            out = [{**detections, "labels": detections["labels"] - 1} for detections in out]
        return out

    def save_pretrained(self, folder: Path) -> Path:
        """The hub mixin's layout: config.json (the ``__init__`` arguments) and model.safetensors (the state dict,
        torchvision's keys)."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / "model.safetensors"))
        return folder


def calibrate_batch_norms(model: torch.nn.Module, image: torch.Tensor) -> None:
    """Give the backbone's frozen batch norms the statistics of ``image``'s features (a random network's
    activations otherwise grow through its 50 layers), as a trained model's are: in one eval pass, each norm takes
    its input's per-channel mean and variance before it normalizes."""

    def estimate(norm: FrozenBatchNorm2d, args: tuple) -> None:
        norm.running_mean.copy_(args[0].mean(dim=(0, 2, 3)))
        norm.running_var.copy_(args[0].var(dim=(0, 2, 3)))

    norms = [m for m in model.backbone.body.modules() if isinstance(m, FrozenBatchNorm2d)]
    hooks = [norm.register_forward_pre_hook(estimate) for norm in norms]
    with torch.no_grad():
        model.backbone.body(model.transform([image])[0].tensors)
    for hook in hooks:
        hook.remove()


def write_deepforest_maskrcnn(
    folder: Path, label_dict: dict[str, int] | None = None, seed: int = 0, **config
) -> DeepForestMaskRCNN:
    """A random DeepForest Mask R-CNN (fixed seed, batch norms calibrated on a random image) written with its
    ``save_pretrained``; ``config``: its ``__init__``'s other arguments (thresholds, torchvision keyword arguments).
    Returns the model, in eval mode."""
    torch.manual_seed(seed)
    model = DeepForestMaskRCNN(num_classes=len(label_dict or TREE), label_dict=label_dict or TREE, **config).eval()
    calibrate_batch_norms(model, torch.rand(3, 128, 128))
    model.save_pretrained(folder)
    return model
