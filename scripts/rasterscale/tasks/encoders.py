"""The dense tasks' networks without torch (segmentation's and regression's): the segmentation-models-pytorch
architectures a config may name (``model.architecture``), the encoder names it may give (``model.encoder``) and the
checks of a local encoder weights file (``model.encoder_weights``), all read at dry run. The network is built by
:mod:`rasterscale.tasks.smpnet` (torch).

Encoder names (:func:`encoder_name`):

- an encoder of segmentation-models-pytorch's own (:data:`SMP_ENCODERS`, ``smp.encoders.get_encoder_names()`` of
  the pinned 0.6.0), e.g. ``resnet50``, ``efficientnet-b0``, ``mit_b0``: as given;
- ``tu-<name>``, any timm model (smp's timm universal encoder), e.g. ``tu-convnext_atto``: as given;
- a bare timm model name that is not smp's, e.g. ``convnext_atto``: read as ``tu-convnext_atto`` (a name both know,
  e.g. ``resnet50``, is smp's: ``tu-resnet50`` asks for timm's).

The files record the resolved name. timm's model list is read (importing timm, so torch) only for a name that is
not smp's own.

Encoder weights are only ever a local file: a state dict (``torch.save``) of (a) smp's encoder keys or (b) a timm
model, as TorchGeo saves its pretrained weights (e.g. ``ResNet50_Weights.SENTINEL2_ALL_MOCO``: the state dict of
``timm.create_model("resnet50", in_chans=13)``). At dry run (:func:`check_encoder_weights`): the file exists, holds
a state dict, and its first convolution takes the model's input bands. Whether its keys fit the encoder is checked
when training starts (:func:`rasterscale.tasks.smpnet.load_encoder_weights`). rasterscale never downloads: a name
of pretrained weights (``imagenet``) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasterscale.errors import ConfigError, InputError
from rasterscale.settings import ModelSettings
from rasterscale.tasks.modelfiles import NotATorchFile, payload_header, torch_payload

# the segmentation-models-pytorch networks a dense task may build (the schema's model.architecture takes them from
# here); each builds and trains a step at 256 px on the encoders of docs/models.md
ARCHITECTURES: tuple[str, ...] = ("unet", "unetplusplus", "fpn", "deeplabv3plus", "segformer", "upernet")
DEFAULT_ARCHITECTURE = "unet"
# (architecture, encoder name prefix) that segmentation-models-pytorch 0.6.0 refuses to build
REFUSED: tuple[tuple[str, str], ...] = (("unetplusplus", "mit_b"),)
DEFAULT_ENCODER = "resnet18"
TIMM_PREFIX = "tu-"
UNET_DECODER = (128, 64, 32, 16, 8)  # the dense tasks' U-Net decoder (smp's default is twice as wide)

# smp.encoders.get_encoder_names() of segmentation-models-pytorch 0.6.0 (tests/test_encoders.py holds them equal)
SMP_ENCODERS: tuple[str, ...] = (
    *("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"),
    *("resnext50_32x4d", "resnext101_32x4d", "resnext101_32x8d", "resnext101_32x16d"),
    *("resnext101_32x32d", "resnext101_32x48d"),
    *("dpn68", "dpn68b", "dpn92", "dpn98", "dpn107", "dpn131"),
    *("vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn"),
    *("senet154", "se_resnet50", "se_resnet101", "se_resnet152", "se_resnext50_32x4d", "se_resnext101_32x4d"),
    *("densenet121", "densenet169", "densenet201", "densenet161", "inceptionresnetv2", "inceptionv4"),
    *(f"efficientnet-b{k}" for k in range(8)),
    *("mobilenet_v2", "xception"),
    *(f"timm-efficientnet-b{k}" for k in range(9)),
    "timm-efficientnet-l2",
    *(f"timm-tf_efficientnet_lite{k}" for k in range(5)),
    *("timm-skresnet18", "timm-skresnet34", "timm-skresnext50_32x4d"),
    *(f"mit_b{k}" for k in range(6)),
    *(f"mobileone_s{k}" for k in range(5)),
)


def timm_knows(name: str) -> bool:
    """Whether timm has a model ``name`` (imports timm, and so torch: only for names that are not smp's)."""
    import timm

    return bool(timm.is_model(name))


def encoder_name(value: str) -> str:
    """The encoder a ``model.encoder`` value names, as smp builds it (see the module docstring); one-line
    ConfigError for a name neither smp nor timm knows."""
    if value in SMP_ENCODERS:
        return value
    bare = value.removeprefix(TIMM_PREFIX)
    if bare and timm_knows(bare):
        return TIMM_PREFIX + bare
    raise ConfigError(f"model.encoder: {value!r} is neither a segmentation-models-pytorch nor a timm encoder")


def default_decoder(architecture: str) -> tuple[int, ...] | None:
    """The decoder widths a new network of ``architecture`` gets: :data:`UNET_DECODER` for a U-Net, else None
    (smp's own)."""
    return UNET_DECODER if architecture == "unet" else None


def dense_network(
    model: ModelSettings, path: str | None, recorded: tuple[str, str] | None, task: str
) -> tuple[str, str]:
    """The (architecture, encoder) of a dense task's config: ``model.architecture`` and ``model.encoder`` as set,
    else what the model file ``path`` records (``recorded``), else a U-Net on ResNet-18. A key that contradicts the
    file, or ``model.backbone`` (detection's and instances' key), fails with one line."""
    if model.backbone is not None:
        raise ConfigError(
            f"config: key 'model.backbone' is for detection and instances; {task}'s network takes model.encoder "
            f"(e.g. encoder: {model.backbone})"
        )
    architecture = model.architecture or (recorded[0] if recorded else DEFAULT_ARCHITECTURE)
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"config: key 'model.architecture' is {architecture!r} (one of {', '.join(ARCHITECTURES)})")
    given = model.encoder
    encoder = encoder_name(given) if given else (recorded[1] if recorded else DEFAULT_ENCODER)
    refused = next((prefix for arch, prefix in REFUSED if arch == architecture and encoder.startswith(prefix)), None)
    if refused is not None:
        raise ConfigError(
            f"config: key 'model.encoder' is {encoder}, which segmentation-models-pytorch's {architecture} does not "
            f"take ({refused}* encoders): pick another encoder or model.architecture"
        )
    if recorded is not None and (architecture, encoder) != recorded:
        raise InputError(
            f"{path}: a {recorded[0]} on {recorded[1]}, but model.architecture/model.encoder ask for a {architecture} "
            f"on {encoder}; leave them out to use the file's"
        )
    return architecture, encoder


# --- encoder weights: a local file ------------------------------------------------------------------------------

WEIGHTS_KEY = "model.encoder_weights"


@dataclass(frozen=True)
class EncoderWeights:
    """What a dry run knows of an encoder weights file: its first convolution (key) and the bands it takes."""

    path: str
    first_conv: str
    in_channels: int
    tensors: int


def looks_like_a_name(value: str) -> bool:
    """A value that names pretrained weights (``imagenet``, ``ssl``) rather than a file: no folder, no suffix."""
    return "/" not in value and "\\" not in value and not Path(value).suffix


def read_state_dict_header(path: Path) -> Mapping[str, Any]:
    """A file's state dict, its tensors as headers (torch-free, from the zip format's pickle) or memory-mapped
    tensors (torch, for the legacy format); one-line InputError naming the file when it holds no state dict."""
    payload = payload_header(path)
    if payload is None:
        try:
            payload = torch_payload(path)
        except NotATorchFile:
            raise InputError(f"{path}: not a torch-saved state dict ({WEIGHTS_KEY})") from None
    if isinstance(payload, Mapping) and "format" in payload and "state_dict" in payload:
        raise InputError(
            f"{path}: a rasterscale model file ({payload['format']}), not encoder weights: give it as train.init "
            f"instead of {WEIGHTS_KEY}"
        )
    tensors = isinstance(payload, Mapping) and payload and all(hasattr(v, "shape") for v in payload.values())
    if not tensors:
        raise InputError(f"{path}: not a state dict (a mapping of names to tensors) ({WEIGHTS_KEY})")
    return payload


def check_encoder_weights(value: str, bands: int) -> EncoderWeights:
    """The encoder weights file ``value`` (``model.encoder_weights``) for a model of ``bands`` input bands, read at
    dry run: one line when it is a name of weights to download, is missing, holds no state dict, or its first
    convolution takes another number of bands."""
    path = Path(value)
    if not path.exists():
        if looks_like_a_name(value):
            raise ConfigError(
                f"config: key '{WEIGHTS_KEY}' is {value!r}, a name of pretrained weights, but rasterscale never "
                "downloads: give a local file (an encoder state dict saved with torch.save, e.g. TorchGeo's or timm's)"
            )
        raise InputError(f"{path}: encoder weights file not found ({WEIGHTS_KEY})")
    if path.is_dir():
        raise InputError(f"{path}: a folder, not an encoder state dict file ({WEIGHTS_KEY})")
    state = read_state_dict_header(path)
    first = next((k for k, v in state.items() if len(v.shape) == 4), None)
    if first is None:
        raise InputError(f"{path}: a state dict without convolution weights, not an encoder's ({WEIGHTS_KEY})")
    channels = int(state[first].shape[1])
    if channels != bands:
        raise InputError(
            f"{path}: the encoder weights take {channels} bands (their first convolution, {first}) but the model's "
            f"input has {bands} bands ({WEIGHTS_KEY})"
        )
    return EncoderWeights(str(path), first, channels, len(state))


def checked_encoder_weights(model: ModelSettings, path: str | None, new_head: bool, bands: int) -> str:
    """``model.encoder_weights`` of a dense task's config, checked (:func:`check_encoder_weights`): it starts a new
    network's encoder, so it is refused beside ``model.file`` (nothing trains) or ``train.init`` (which starts
    every weight). Empty: none."""
    value = model.encoder_weights
    if not value:
        return ""
    if path is not None:
        other = "train.init, which starts every weight" if new_head else "model.file, with which nothing trains"
        raise ConfigError(f"config: key '{WEIGHTS_KEY}' is set beside {other}: keep one of them")
    check_encoder_weights(value, bands)
    return value
