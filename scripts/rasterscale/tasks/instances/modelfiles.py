"""Instance models' files without torch: what an instance model is (:class:`InstanceConfig`), what a model file
says about itself (:func:`read_header`) and the effective model of a config (:func:`instances_of_config`), read
at dry run. The network itself lives in :mod:`rasterscale.tasks.instances.model`.

rasterscale reads two formats, both holding torchvision Mask R-CNN weights on a ResNet-FPN backbone:

- a rasterscale model file (``.pt``, written by :func:`rasterscale.tasks.instances.model.save_instance_model`):
  ``{"format": INSTANCES_FORMAT, "task": "instances", "model": InstanceConfig.to_dict(), "state_dict", "meta"}``;
- a DeepForest Mask R-CNN folder as ``deepforest.models.maskrcnn.Model.save_pretrained`` writes it (DeepForest's
  main branch; its 2.1.0 release has no Mask R-CNN): ``config.json`` with ``num_classes``, ``nms_thresh``,
  ``score_thresh``, ``label_dict`` and the keyword arguments it passes on to torchvision's ``MaskRCNN`` (e.g.
  ``box_detections_per_img``); ``model.safetensors`` with torchvision's own keys.

Both headers are read without torch: a folder's safetensors header, a ``.pt`` file's pickle with its tensors as
shapes (:func:`rasterscale.tasks.modelfiles.payload_header`). DeepForest's ``num_classes`` counts the objects'
classes; the weights' box and mask predictors have one more, torchvision's background (class 0). Labels are
0-based everywhere in rasterscale, as in DeepForest.

DeepForest's model sees its patches through torchvision's transform (``min_size=800, max_size=1333``): that input
scale is part of a DeepForest model unless its config.json says otherwise (``min_size``/``max_size``, which
rasterscale writes). A model file of another task (a RetinaNet, a segmenter) fails with one line naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasterscale.settings import Settings
from rasterscale.tasks.detectors.modelfiles import (
    DetectorHeader,
    ResNetFPNConfig,
    effective_model,
    existing_model_path,
    pick,
    read_hub_folder,
    read_payload,
    resnet_of_weights,
    resolve_detector_keys,
    write_hub_folder,
)
from rasterscale.tasks.modelfiles import model_file_error, other_tasks_model, payload_header, shapes_of

TASK = "instances"
INSTANCES_FORMAT = "rasterscale-instances/1"
BOX_HEAD_WIDTH = 4  # the box head's features per pyramid channel: torchvision's 1024 for 256 channels
MASK_HEAD_LAYERS = 4  # convolutions of the mask head (torchvision's MaskRCNNHeads), each as wide as the pyramid

CLASS_SCORE = "roi_heads.box_predictor.cls_score."
BOX_DELTAS = "roi_heads.box_predictor.bbox_pred."
MASK_LOGITS = "roi_heads.mask_predictor.mask_fcn_logits."
CLASS_LAYERS = (CLASS_SCORE, BOX_DELTAS, MASK_LOGITS)  # their shapes depend on the number of classes
PYRAMID = "backbone.fpn.layer_blocks.0.0.weight"
RETINANET_LOGITS = "head.classification_head.cls_logits.weight"

NOT_A_MODEL = (
    "not an instance segmentation model file rasterscale reads (a rasterscale .pt file of format "
    f"{INSTANCES_FORMAT}, or a DeepForest Mask R-CNN folder with config.json and model.safetensors)"
)


@dataclass(frozen=True)
class InstanceConfig(ResNetFPNConfig):
    """What builds an instance model: a torchvision Mask R-CNN (the fields and defaults of
    :class:`ResNetFPNConfig`; the network adds torchvision's background class to the labels). A mask pixel belongs
    to an instance where its probability is at least ``mask_threshold`` (above 0: at 0 a mask would be its whole
    crop)."""

    # torchvision's Mask R-CNN keeps 100 detections per image: each costs a mask head pass and a full-tile mask
    detections_per_tile: int = 100
    mask_threshold: float = 0.5

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("an instance model needs at least 1 class")
        if not 0 < self.mask_threshold <= 1:
            raise ValueError(f"mask_threshold {self.mask_threshold} is not a probability above 0")

    @property
    def num_classes(self) -> int:
        """The network's classes: the labels and torchvision's background (class 0)."""
        return len(self.labels) + 1

    def describe(self) -> str:
        """One line for the logs: labels, input scale and the thresholds."""
        return (
            f"labels {', '.join(self.labels)}, FPN {self.fpn_channels} channels, {self.describe_resize()}, "
            f"score {self.score_threshold:.3g}, nms {self.nms_threshold:.3g}, mask {self.mask_threshold:.3g}, "
            f"{self.detections_per_tile} detections per tile"
        )


@dataclass(frozen=True)
class ModelHeader(DetectorHeader):
    """What an instance model file says about itself: a detector's header and the mask threshold."""

    mask_threshold: float | None = None


# --- reading -------------------------------------------------------------------------------------------------


def architecture(path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int, int]:
    """(backbone, number of classes without the background, FPN channels) of Mask R-CNN weights, from their keys
    and the predictors' and feature pyramid's shapes; one line saying what the weights are otherwise."""
    if RETINANET_LOGITS in shapes:
        raise model_file_error(
            path,
            f"a RetinaNet's weights (boxes only: a model of task detection), but task is {TASK} "
            "(set task: detection, or give a Mask R-CNN)",
        )
    scores, masks = shapes.get(CLASS_SCORE + "weight"), shapes.get(MASK_LOGITS + "weight")
    if scores is None or PYRAMID not in shapes:
        raise model_file_error(
            path, f"{NOT_A_MODEL}: its weights are not a torchvision Mask R-CNN with a ResNet-FPN backbone"
        )
    if masks is None:
        raise model_file_error(path, f"a Faster R-CNN's weights (no mask head), not a Mask R-CNN's: {TASK} needs masks")
    if masks[0] != scores[0] or scores[0] < 2:
        raise model_file_error(
            path,
            f"box predictor has {scores[0]} classes and mask predictor {masks[0]}: not the same, at least the "
            "background and one class",
        )
    backbone, fpn_channels = resnet_of_weights(path, shapes), shapes[PYRAMID][0]
    box_head = shapes.get("roi_heads.box_head.fc6.weight")
    if box_head is not None and box_head[0] != BOX_HEAD_WIDTH * fpn_channels:
        raise model_file_error(
            path,
            f"box head of {box_head[0]} features; rasterscale's Mask R-CNN has {BOX_HEAD_WIDTH} per pyramid "
            f"channel ({BOX_HEAD_WIDTH * fpn_channels})",
        )
    return backbone, scores[0] - 1, fpn_channels


def _folder_header(path: Path) -> ModelHeader:
    """A DeepForest Mask R-CNN folder's header (its ``num_classes``, like the weights' classes here, without the
    background)."""
    folder = read_hub_folder(path)
    found = architecture(path, folder.shapes)
    mask_threshold = folder.ours.get("mask_threshold")
    return ModelHeader.of_hub_folder(path, folder, found, "box_detections_per_img", mask_threshold=mask_threshold)


def _is_weights(value: Any) -> bool:
    """A non-empty mapping of tensors (or of :class:`~rasterscale.tasks.modelfiles.TensorHeader`)."""
    return isinstance(value, Mapping) and bool(value) and all(hasattr(v, "shape") for v in value.values())


def _header_of_payload(path: Path, payload: Any) -> ModelHeader:
    """The header of a torch-saved payload (its tensors, or only their headers)."""
    if isinstance(payload, Mapping) and payload.get("format") == INSTANCES_FORMAT:
        if not isinstance(payload.get("model"), Mapping) or not _is_weights(payload.get("state_dict")):
            raise model_file_error(path, f"a {INSTANCES_FORMAT} file without its model or state_dict")
        try:
            cfg = InstanceConfig.from_dict(payload["model"])
        except (KeyError, TypeError, ValueError) as err:
            raise model_file_error(path, f"bad instance model configuration ({err})") from None
        found, meta = architecture(path, shapes_of(payload["state_dict"])), dict(payload.get("meta") or {})
        return ModelHeader.of_model_file(path, cfg, found, meta, mask_threshold=cfg.mask_threshold)
    other = other_tasks_model(path, payload, TASK)
    if other:
        raise model_file_error(path, other)
    weights = payload.get("state_dict", payload) if isinstance(payload, Mapping) else None
    if isinstance(weights, Mapping) and _is_weights(weights):  # a bare state dict or a checkpoint: say what it is
        architecture(path, {k.removeprefix("model."): v for k, v in shapes_of(weights).items()})
        raise model_file_error(path, f"{NOT_A_MODEL}: bare Mask R-CNN weights, without the model's configuration")
    raise model_file_error(path, NOT_A_MODEL)


def read_header(path: str | Path) -> ModelHeader:
    """What an instance model file says about itself, without torch (a folder's safetensors header, a ``.pt``
    file's pickle; torch only for a ``.pt`` file in torch's legacy format); one-line :class:`InputError` naming
    the file when it is not an instance model file rasterscale reads or contradicts itself."""
    path = existing_model_path(path)
    if path.is_dir():
        return _folder_header(path)
    payload = payload_header(path)
    return _header_of_payload(path, payload if payload is not None else read_payload(path, NOT_A_MODEL))


def read_model_file(path: str | Path) -> tuple[ModelHeader, dict[str, Any]]:
    """The header and the state dict (torchvision Mask R-CNN keys) of a model file (torch imported)."""
    path = existing_model_path(path)
    if path.is_dir():
        from safetensors.torch import load_file

        return _folder_header(path), load_file(str(path / "model.safetensors"), device="cpu")
    payload = read_payload(path, NOT_A_MODEL)
    return _header_of_payload(path, payload), dict(payload["state_dict"])


# --- resolving ------------------------------------------------------------------------------------------------


def resolve_instances(settings: Settings | None, header: ModelHeader | None, new_head: bool = False) -> InstanceConfig:
    """The effective instance model: each ``model.*`` key the user set, else what the model file says, else
    rasterscale's default. ``new_head``: the file is a starting point (``train.init``), so other labels replace
    its class layers; otherwise (prediction) the labels must number the file's classes
    (:func:`rasterscale.tasks.detectors.modelfiles.resolve_detector_keys`)."""
    mask_threshold = pick(
        settings.model.mask_threshold if settings is not None else None,
        header and header.mask_threshold,
        InstanceConfig.mask_threshold,
    )
    return InstanceConfig(
        **resolve_detector_keys(settings, header, new_head, InstanceConfig), mask_threshold=mask_threshold
    )


def instances_of_config(settings: Settings) -> tuple[InstanceConfig, ModelHeader | None]:
    """The effective instance model of a validated config, reading the header of the model file it names
    (``model.file``, else ``train.init``)."""
    return effective_model(settings, read_header, resolve_instances)


# --- writing --------------------------------------------------------------------------------------------------


def write_deepforest_maskrcnn_folder(state_dict: Mapping[str, Any], cfg: InstanceConfig, folder: str | Path) -> Path:
    """Write ``folder/config.json`` + ``folder/model.safetensors`` as DeepForest's Mask R-CNN writes them, atomically
    (:func:`rasterscale.tasks.detectors.modelfiles.write_hub_folder`: torchvision's keys, no batch-norm step
    counters). What config.json cannot hold for DeepForest (backbone, native scale, patch size, mask threshold) goes
    into the safetensors metadata."""
    return write_hub_folder(folder, cfg, "box_detections_per_img", state_dict, mask_threshold=cfg.mask_threshold)
