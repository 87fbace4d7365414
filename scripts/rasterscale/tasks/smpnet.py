"""The torch half of the dense tasks' networks: a segmentation-models-pytorch network of any architecture and
encoder (:mod:`rasterscale.tasks.encoders` says which are allowed), built without any download, its head in fp32
under autocast; and its encoder started from a local weights file (``model.encoder_weights``).

An encoder weights file holds smp's encoder keys, or a timm model's (TorchGeo's pretrained weights are state dicts
of timm models). Its keys are matched to the encoder's as they are, with smp's timm-universal prefix ``model.``
added, or with it removed (whichever matches most); torchvision-style ResNet keys (smp's ``resnet50``) are timm's
ResNet keys, so one file fits both ``resnet50`` and ``tu-resnet50``. Every tensor of the encoder must be in the file
with its shape (batch norms' step counters excepted); the file's other tensors (a classifier, ``fc.*``) are left
out and named in the log line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from rasterscale.errors import ConfigError, InputError
from rasterscale.runtime.precision import float32_conv
from rasterscale.tasks.encoders import WEIGHTS_KEY
from rasterscale.tasks.modelfiles import torch_payload

TIMM_MODULE = "model."  # smp's timm universal encoder holds the timm model as .model
OPTIONAL = "num_batches_tracked"  # batch norms' step counters: a file may leave them out


def build_network(
    architecture: str,
    encoder: str,
    in_channels: int,
    classes: int,
    decoder_channels: tuple[int, ...] | None = None,
) -> torch.nn.Module:
    """A freshly initialized smp network (``encoder_weights=None``: nothing downloaded), no output activation, its
    head's convolution in fp32 under autocast (:mod:`rasterscale.runtime.precision`)."""
    import segmentation_models_pytorch as smp

    kwargs = {"decoder_channels": list(decoder_channels)} if decoder_channels is not None else {}
    try:
        net = smp.create_model(
            architecture,
            encoder_name=encoder,
            encoder_weights=None,
            classes=classes,
            in_channels=in_channels,
            activation=None,
            **kwargs,
        )
    except (ValueError, KeyError, RuntimeError, AttributeError, TypeError) as err:  # what smp and timm raise
        detail = (str(err).splitlines() or [type(err).__name__])[0][:160]
        raise ConfigError(
            f"config: segmentation-models-pytorch cannot build a {architecture} on {encoder} with {in_channels} "
            f"bands ({detail}): pick another model.encoder or model.architecture"
        ) from None
    net.segmentation_head[0] = float32_conv(net.segmentation_head[0])
    return net


def _key_variants(keys: list[str]) -> list[dict[str, str]]:
    """Ways to name a file's keys as an encoder's: as they are, with smp's ``model.`` prefix, without it."""
    return [
        {k: k for k in keys},
        {k: TIMM_MODULE + k for k in keys},
        {k: k.removeprefix(TIMM_MODULE) for k in keys if k.startswith(TIMM_MODULE)},
    ]


def matched_state(
    path: str | Path, state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The file's tensors under the encoder's names, and the file's keys left out (not the encoder's); one-line
    InputError naming the file when a tensor of the encoder is missing or has another shape."""
    renamed = max(_key_variants(list(state)), key=lambda names: len(set(names.values()) & set(own)))
    matched = {renamed[k]: v for k, v in state.items() if renamed.get(k) in own}
    missing = [k for k in own if k not in matched and not k.endswith(OPTIONAL)]
    if missing:
        raise InputError(
            f"{path}: {len(missing)} of the encoder's {len(own)} tensors are not in the file, e.g. {missing[0]} "
            f"({WEIGHTS_KEY}: weights of another network?)"
        )
    wrong = [k for k, v in matched.items() if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        key = wrong[0]
        raise InputError(
            f"{path}: {len(wrong)} tensors differ in shape from the encoder's, e.g. {key} "
            f"{list(matched[key].shape)} against {list(own[key].shape)} ({WEIGHTS_KEY})"
        )
    return matched, [k for k in state if renamed.get(k) not in own]


def load_encoder_weights(encoder: torch.nn.Module, path: str | Path, name: str) -> str:
    """Start ``encoder`` (named ``name``) from the state dict file ``path``; what was loaded, for the log."""
    try:
        state = torch_payload(Path(path))
    except InputError:
        raise InputError(f"{path}: not a torch-saved state dict ({WEIGHTS_KEY})") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"{path}: not a state dict (a mapping of names to tensors) ({WEIGHTS_KEY})")
    matched, left_out = matched_state(path, state, encoder.state_dict())
    encoder.load_state_dict(matched, strict=False)
    shown = ", ".join(left_out[:4]) + (", ..." if len(left_out) > 4 else "")
    ignored = f"; {len(left_out)} tensors of the file not in the encoder left out ({shown})" if left_out else ""
    return f"encoder {name} from {path} ({len(matched)} tensors){ignored}"
