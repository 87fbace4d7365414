"""Model files in and out, and the detector configuration they resolve to.

rasterscale reads four formats, all holding torchvision RetinaNet weights on a ResNet-FPN backbone:

- a rasterscale model file (``.pt``, written by :func:`rasterscale.tasks.detection.model.save_detector`);
- a DeepForest model folder as ``RetinaNetHub.save_pretrained`` writes it (``config.json`` with ``label_dict``,
  ``num_classes``, ``score_thresh``, ``nms_thresh``; ``model.safetensors``, keys with or without the ``model.``
  prefix of older releases);
- a DeepForest Lightning checkpoint (``.ckpt``: ``state_dict`` keys under ``model.``, ``label_dict``);
- a legacy DeepForest state dict (``.pt``, e.g. ``NEON.pt``).

:func:`read_header` reads what a file says cheaply (labels, classes, backbone depth from the weights' keys,
thresholds, input scale); :func:`resolve_detector` turns the validated config and that header into the one
:class:`DetectorConfig` that training and prediction use: every ``model.*`` key the user sets overrides the file.
:func:`write_deepforest_folder` writes a model the way DeepForest 2.1.0 loads it (``RetinaNetHub.from_pretrained``).

DeepForest's models see their patches through torchvision's ``GeneralizedRCNNTransform`` with ``min_size=800,
max_size=1333`` (a 400 px patch is upsampled to 800 px): that input scale is part of a DeepForest model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasterscale.settings import Settings
from rasterscale.tasks.detectors.modelfiles import (
    DEEPFOREST_RESIZE,
    DetectorHeader,
    ResNetFPNConfig,
    effective_model,
    existing_model_path,
    labels_from_dict,
    read_hub_folder,
    read_payload,
    resnet_of_weights,
    resolve_detector_keys,
    write_hub_folder,
)
from rasterscale.tasks.modelfiles import is_state_dict, model_file_error, other_tasks_model, shapes_of

DETECTOR_FORMAT = "rasterscale-detector/1"
NUM_ANCHORS = 9  # torchvision's default anchor generator: 3 sizes x 3 aspect ratios per location
CLASS_LOGITS = "head.classification_head.cls_logits."


@dataclass(frozen=True)
class DetectorConfig(ResNetFPNConfig):
    """What builds a detector: a torchvision RetinaNet (the fields and defaults of :class:`ResNetFPNConfig`)."""

    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the logs: labels, input scale and the detection thresholds."""
        return (
            f"labels {', '.join(self.labels)}, FPN {self.fpn_channels} channels, {self.describe_resize()}, "
            f"score {self.score_threshold:.3g}, "
            f"nms {self.nms_threshold:.3g}, {self.detections_per_tile} detections per tile"
        )


ModelHeader = DetectorHeader  # what a RetinaNet file says about itself


# --- reading -------------------------------------------------------------------------------------------------


NOT_A_MODEL = (
    "not a model file rasterscale reads (a rasterscale .pt file, a DeepForest model folder with config.json "
    "and model.safetensors, a DeepForest Lightning .ckpt or a DeepForest .pt state dict)"
)


def _strip_prefix(keys_or_dict: Any) -> Any:
    """Keys without DeepForest's ``model.`` prefix (older releases and Lightning checkpoints carry it)."""
    if isinstance(keys_or_dict, Mapping):
        return {k.removeprefix("model."): v for k, v in keys_or_dict.items()}
    return [k.removeprefix("model.") for k in keys_or_dict]


def architecture(path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int, int]:
    """(backbone, num_classes, FPN channels) of RetinaNet weights, from their keys and the class head's and
    feature pyramid's shapes."""
    shapes = {k.removeprefix("model."): v for k, v in shapes.items()}
    logits = shapes.get(CLASS_LOGITS + "weight")
    if logits is None or "backbone.fpn.layer_blocks.0.0.weight" not in shapes:
        raise model_file_error(
            path, f"{NOT_A_MODEL}: its weights are not a torchvision RetinaNet with a ResNet-FPN backbone"
        )
    backbone = resnet_of_weights(path, shapes)
    if logits[0] % NUM_ANCHORS:
        raise model_file_error(path, f"class head has {logits[0]} outputs, not a multiple of {NUM_ANCHORS} anchors")
    return backbone, logits[0] // NUM_ANCHORS, shapes["backbone.fpn.layer_blocks.0.0.weight"][0]


def _folder_header(path: Path) -> ModelHeader:
    folder = read_hub_folder(path)
    return ModelHeader.of_hub_folder(path, folder, architecture(path, folder.shapes), "detections_per_img")


def _header_of_payload(path: Path, payload: Any) -> tuple[ModelHeader, dict[str, Any]]:
    """The header of a torch-saved file and its state dict (keys without the ``model.`` prefix)."""
    other = other_tasks_model(path, payload, "detection")
    if other:
        raise model_file_error(path, other)
    if isinstance(payload, Mapping) and payload.get("format") == DETECTOR_FORMAT:
        cfg = DetectorConfig.from_dict(payload["model"])
        state = dict(payload["state_dict"])
        found = architecture(path, shapes_of(state))
        header = ModelHeader.of_model_file(path, cfg, found, dict(payload.get("meta", {})))
        return header, state
    if isinstance(payload, Mapping) and is_state_dict(payload.get("state_dict")):
        # a Lightning checkpoint of DeepForest's module: the detector is its `model` attribute
        state = {k.removeprefix("model."): v for k, v in payload["state_dict"].items() if k.startswith("model.")}
        backbone, classes, fpn_channels = architecture(path, shapes_of(state))
        hyper = (payload.get("hyper_parameters") or {}).get("config") or {}  # DeepForest's config
        label_dict = payload.get("label_dict") or hyper.get("label_dict")
        header = ModelHeader(
            str(path),
            "DeepForest Lightning checkpoint",
            backbone,
            classes,
            labels_from_dict(path, label_dict, classes) if label_dict else None,
            hyper.get("score_thresh"),
            hyper.get("nms_thresh"),
            hyper.get("detections_per_img"),
            DEEPFOREST_RESIZE,
            hyper.get("patch_size"),
            fpn_channels=fpn_channels,
        )
        return header, state
    if is_state_dict(payload):
        state = _strip_prefix(payload)
        backbone, classes, fpn_channels = architecture(path, shapes_of(state))
        header = ModelHeader(
            str(path), "DeepForest state dict", backbone, classes, resize=DEEPFOREST_RESIZE, fpn_channels=fpn_channels
        )
        return header, state
    raise model_file_error(path, NOT_A_MODEL)


def read_header(path: str | Path) -> ModelHeader:
    """What a model file says about itself; one-line :class:`InputError` naming the file when it is not a model
    file rasterscale reads or contradicts itself."""
    path = existing_model_path(path)
    if path.is_dir():
        return _folder_header(path)
    return _header_of_payload(path, read_payload(path, NOT_A_MODEL))[0]


def read_model_file(path: str | Path) -> tuple[ModelHeader, dict[str, Any]]:
    """The header and the state dict (torchvision RetinaNet keys, no ``model.`` prefix) of a model file."""
    path = existing_model_path(path)
    if path.is_dir():
        from safetensors.torch import load_file

        return _folder_header(path), _strip_prefix(load_file(str(path / "model.safetensors"), device="cpu"))
    return _header_of_payload(path, read_payload(path, NOT_A_MODEL))


# --- resolving ------------------------------------------------------------------------------------------------


def resolve_detector(settings: Settings | None, header: ModelHeader | None, new_head: bool = False) -> DetectorConfig:
    """The effective detector: each ``model.*`` key the user set, else what the model file says, else rasterscale's
    default. ``new_head``: the file is a starting point (``train.init``), so other labels replace its class head;
    otherwise (prediction) the labels must number the file's classes
    (:func:`rasterscale.tasks.detectors.modelfiles.resolve_detector_keys`).
    """
    return DetectorConfig(**resolve_detector_keys(settings, header, new_head, DetectorConfig))


def detector_of_config(settings: Settings) -> tuple[DetectorConfig, ModelHeader | None]:
    """The effective detector of a validated config, reading the header of the model file it names."""
    return effective_model(settings, read_header, resolve_detector)


# --- writing --------------------------------------------------------------------------------------------------


def write_deepforest_folder(state_dict: Mapping[str, Any], cfg: DetectorConfig, folder: str | Path) -> Path:
    """Write ``folder/config.json`` + ``folder/model.safetensors`` atomically, keys as DeepForest 2.1.0 writes
    them (:func:`rasterscale.tasks.detectors.modelfiles.write_hub_folder`). What config.json cannot hold for
    DeepForest (backbone, native scale, patch size) goes into the safetensors metadata."""
    return write_hub_folder(folder, cfg, "detections_per_img", state_dict)
