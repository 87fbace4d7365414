"""What the tasks whose models are torchvision detectors on a ResNet-FPN backbone share (detection's RetinaNet,
instances' Mask R-CNN), on the torch side: the backbone built without any download, the transform that keeps
tiles at their native scale unless the model records a resize, loading a model file's weights strictly, an
ImageNet start for the backbone, and fine-tuning a pretrained backbone as torchvision and DeepForest do.

What their model files share (torch-free) is in :mod:`rasterscale.tasks.detectors.modelfiles`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torchvision.models import resnet
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.misc import FrozenBatchNorm2d

from rasterscale.errors import InputError
from rasterscale.raster.bands import InputBands
from rasterscale.runtime.fastpath import fuse_conv_bn, to_channels_last
from rasterscale.tasks.inputlayer import adapt_state_dict, and_then

if TYPE_CHECKING:
    from torchvision.models.detection import MaskRCNN, RetinaNet
    from torchvision.ops.feature_pyramid_network import ExtraFPNBlock


class PatchTransform(GeneralizedRCNNTransform):
    """Normalizes (by the input bands' statistics: ImageNet's for RGB) and batches tiles; resizes them only when
    the model records a resize ``(min_size, max_size)`` (torchvision's own resize, boxes (and masks) mapped back to
    tile pixels by ``postprocess``). Without one, tiles keep their own size and boxes stay in tile pixels."""

    def __init__(self, patch_size: int, resize: tuple[int, int] | None = None, bands: InputBands | None = None) -> None:
        min_size, max_size = resize or (patch_size, patch_size)
        bands = bands or InputBands()
        super().__init__(min_size, max_size, list(bands.mean), list(bands.std))
        self.native = resize is None

    def resize(self, image: torch.Tensor, target: dict[str, torch.Tensor] | None = None) -> tuple:
        if self.native:
            return image, target
        return super().resize(image, target)


def resnet_fpn(
    backbone: str,
    returned_layers: Sequence[int],
    fpn_channels: int,
    extra_blocks: Callable[[], ExtraFPNBlock] | None = None,
    bands: int = 3,
) -> BackboneWithFPN:
    """A ResNet (``resnet18`` ... ``resnet101``, random weights, trainable batch norms) with a feature pyramid of
    ``fpn_channels`` channels over its stages ``returned_layers``: torchvision's ``_resnet_fpn_extractor`` with
    every layer trainable, its keys (``backbone.body.*``, ``backbone.fpn.*``) and any pyramid width.
    ``extra_blocks`` makes the pyramid's extra levels (default: torchvision's max-pooled P6), after the ResNet: the
    modules are made, and draw their random weights, in the order torchvision's builders make them (a seed gives
    the weights it gave before). ``bands``: the input's band count (its first convolution takes as many)."""
    body = getattr(resnet, backbone)(weights=None)
    if bands != body.conv1.in_channels:
        stem = body.conv1
        body.conv1 = torch.nn.Conv2d(bands, stem.out_channels, stem.kernel_size, stem.stride, stem.padding, bias=False)
        torch.nn.init.kaiming_normal_(body.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision's
    width = body.inplanes // 8  # channels of layer1's output
    return BackboneWithFPN(
        body,
        {f"layer{k}": str(v) for v, k in enumerate(returned_layers)},
        [width * 2 ** (k - 1) for k in returned_layers],
        fpn_channels,
        extra_blocks=extra_blocks() if extra_blocks else None,
    )


def load_weights(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    path: str | Path,
    skip: str | tuple[str, ...] = "",
    what: str = "the detector",
) -> None:
    """Load a file's weights into ``module`` (the model, or its backbone's ResNet: ``what``), strictly except
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


def load_backbone_weights(
    model: RetinaNet | MaskRCNN, path: str | Path, bands: InputBands, what: str = "the detector's backbone"
) -> str:
    """Start the backbone's ResNet from a torchvision ImageNet state dict (its ``fc.`` classifier ignored; its RGB
    first convolution adapted to the model's ``bands``)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is the user's to fix
        raise InputError(f"{path}: not a torch state dict ({str(err).splitlines()[0][:120]})") from None
    if not isinstance(state, Mapping) or "conv1.weight" not in state:
        raise InputError(f"{path}: not a torchvision ResNet state dict (model.backbone_weights)")
    weights = {k: v for k, v in state.items() if not k.startswith("fc.")}
    weights, adapted = adapt_state_dict(weights, bands, None, key="conv1.weight")
    load_weights(model.backbone.body, weights, path, what=what)
    return f"backbone from the ImageNet weights {path} ({len(weights)} tensors{and_then(adapted)})"


def adapt_backbone_input(state: Mapping[str, torch.Tensor], bands: InputBands, source: InputBands) -> tuple[dict, str]:
    """A detector's weights with its backbone's first convolution adapted from the file's bands to ``bands``."""
    return adapt_state_dict(state, bands, source, key="backbone.body.conv1.weight")


FROZEN_STEM = ("conv1", "layer1")  # what torchvision (and so DeepForest) keeps fixed in a pretrained backbone


def has_trained_statistics(model: RetinaNet | MaskRCNN) -> bool:
    """Whether the backbone's batch norms hold statistics estimated on data: a model that was never trained keeps
    their initial mean 0 and variance 1, and freezing those would only fix an untrained stem."""
    norms = [m for m in model.backbone.body.modules() if isinstance(m, torch.nn.BatchNorm2d | FrozenBatchNorm2d)]
    return any(_estimated(m) for m in norms)


def _estimated(norm: torch.nn.BatchNorm2d | FrozenBatchNorm2d) -> bool:
    """Whether a batch norm's running statistics moved from their initial mean 0 and variance 1."""
    mean, var = norm.running_mean, norm.running_var
    assert mean is not None and var is not None  # a ResNet's batch norms track running statistics
    return bool((mean != 0).any() or (var != 1).any())


def freeze_pretrained_backbone(model: RetinaNet | MaskRCNN, fix_first_conv: bool = True) -> str:
    """Fine-tune a pretrained backbone as torchvision and DeepForest do: its batch norms frozen (their ImageNet or
    DeepForest statistics kept, not re-estimated from small batches) and its stem (conv1, layer1) fixed; a first
    convolution adapted to other bands (``fix_first_conv`` False) trains, its new bands' filters must learn. A
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
    fixed = FROZEN_STEM if fix_first_conv else FROZEN_STEM[1:]
    for name, parameter in body.named_parameters():
        if name.startswith(fixed):
            parameter.requires_grad_(False)
    return f"backbone batch norms frozen ({frozen}), {' and '.join(fixed)} fixed"


def prepare_for_inference(model: torch.nn.Module, channels_last: bool = True) -> torch.nn.Module:
    """The fast path of a model on a ResNet-FPN backbone (a detector, an instance model): eval mode, batch norms
    folded into convolutions, and (when asked) channels_last weights and input batches (its heads' output layers
    are in fp32 under autocast as built)."""
    model.eval()
    fuse_conv_bn(model)
    if channels_last:
        to_channels_last(model, cast("RetinaNet | MaskRCNN", model).backbone)
    return model
