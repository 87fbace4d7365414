"""What the model files of the tasks whose models are torchvision detectors on a ResNet-FPN backbone share
(detection's RetinaNet, instances' Mask R-CNN), torch-free: the configuration every such model has
(:class:`ResNetFPNConfig`) and what a file says about itself (:class:`DetectorHeader`), the effective settings of a
config over a file's (:func:`resolve_detector_keys`), and DeepForest's model folder (``config.json`` +
``model.safetensors``, read without torch and written atomically) with the ResNet depth of a backbone's weights,
the labels of a ``label_dict`` and the input scale (``model.resize``). Each task's ``modelfiles`` says what its
weights are (:func:`architecture`) and which files it reads.

Reading and writing rasterscale's own payloads (``.pt``), whatever the task, is :mod:`rasterscale.tasks.modelfiles`'.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

from rasterscale.atomic import atomic_folder
from rasterscale.errors import ConfigError, InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import Settings
from rasterscale.tasks.modelfiles import NotATorchFile, model_file_error, starting_model_file, torch_payload
from rasterscale.tasks.modelinput import model_input

DEEPFOREST_RESIZE = (800, 1333)  # torchvision's GeneralizedRCNNTransform defaults, which DeepForest relies on
FOLDER_FILES = ("config.json", "model.safetensors")
SAFETENSORS_KEY = "rasterscale"  # safetensors metadata entry holding what DeepForest's config.json cannot

Resize = tuple[int, int] | None  # (min_size, max_size) of torchvision's transform; None: native scale
DEFAULT_FPN_CHANNELS = 256  # torchvision's and DeepForest's feature pyramid width

# ResNet depth from the block type and the number of blocks in layer3
RESNETS = {("basic", 2): "resnet18", ("basic", 6): "resnet34", ("bottleneck", 6): "resnet50"}
RESNETS[("bottleneck", 23)] = "resnet101"


@dataclass(frozen=True)
class ResNetFPNConfig:
    """What builds a torchvision detector on a ResNet-FPN backbone (``fpn_channels`` wide) of any task, with
    DeepForest's defaults: ``labels`` (0-based), the tile size, the detection thresholds and ``resize``,
    torchvision's ``(min_size, max_size)`` (DeepForest's 800, 1333), or None: tiles at their native size. A task's
    configuration adds its own fields; its dict form is what model files store."""

    backbone: str = "resnet50"
    labels: tuple[str, ...] = ("tree",)
    patch_size: int = 400
    score_threshold: float = 0.3
    nms_threshold: float = 0.4
    detections_per_tile: int = 300
    resize: Resize = None
    fpn_channels: int = DEFAULT_FPN_CHANNELS
    input: InputBands = field(default_factory=InputBands)  # its bands (a file that records none: RGB, scaled)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["labels"] = list(self.labels)
        data["resize"] = list(self.resize) if self.resize else None
        data["input"] = self.input.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        data = dict(data)
        data["labels"] = tuple(data["labels"])
        data["resize"] = tuple(data["resize"]) if data.get("resize") else None
        data["input"] = InputBands.from_dict(data.get("input"))
        return cls(**data)

    def describe_resize(self) -> str:
        return "native scale" if self.resize is None else f"resized to min_size {self.resize[0]}, max {self.resize[1]}"


def deepforest_folder_of(model_path: str | Path) -> Path:
    """The DeepForest model folder written beside a trained model: results/models/{name}/."""
    return Path(model_path).with_suffix("")


DEEPFOREST_BACKBONE = ("resnet50", 256)  # what DeepForest's classes build: resnet50, a 256-channel pyramid


def deepforest_folder_note(folder: Path, what: str, cfg: ResNetFPNConfig) -> str | None:
    """A warning for a DeepForest folder of a model DeepForest's own ``what`` cannot build or feed; None when it
    can."""
    if not cfg.input.is_default:
        return (
            f"{folder}: written for rasterscale (model.file reads it); DeepForest feeds its models RGB scaled to 0-255 "
            f"and cannot run this model of {cfg.input.describe()}"
        )
    if (cfg.backbone, cfg.fpn_channels) == DEEPFOREST_BACKBONE:
        return None
    return (
        f"{folder}: written for rasterscale (model.file reads it); DeepForest's {what} builds resnet50 models with a "
        f"256-channel feature pyramid only and cannot load this {cfg.backbone} with {cfg.fpn_channels}"
    )


def resnet_of_weights(path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The ResNet (resnet18/34/50/101) of a detector's backbone weights (``backbone.body.*`` keys), from its block
    type and the number of blocks in layer3; one-line InputError naming the file otherwise."""
    blocks = {int(m.group(1)) for k in shapes if (m := re.match(r"backbone\.body\.layer3\.(\d+)\.", k))}
    kind = "bottleneck" if "backbone.body.layer1.0.conv3.weight" in shapes else "basic"
    backbone = RESNETS.get((kind, len(blocks)))
    if backbone is None:
        raise InputError(f"{path}: backbone with {len(blocks)} {kind} blocks in layer3 is not resnet18/34/50/101")
    return backbone


def labels_from_dict(path: str | Path, label_dict: Mapping[str, int], num_classes: int) -> tuple[str, ...]:
    """Class names in index order from DeepForest's ``label_dict`` (name -> 0-based index)."""
    by_index = {int(index): str(name) for name, index in label_dict.items()}
    if sorted(by_index) != list(range(num_classes)):
        problem = f"label_dict {dict(label_dict)} does not number the weights' {num_classes} classes 0.."
        raise InputError(f"{path}: {problem}")
    return tuple(by_index[k] for k in range(num_classes))


def same_classes(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """The same classes in the same order, whatever the case (DeepForest's "Tree" is rasterscale's "tree")."""
    return [x.casefold() for x in a] == [x.casefold() for x in b]


def configured_resize(value: Any) -> Resize | Literal["native"]:
    """``model.resize`` as set: ``"native"``, ``{min_size, max_size}`` or ``None`` (the model file's)."""
    if value is None or value == "native":
        return value
    return int(value["min_size"]), int(value["max_size"])


def pick(user: Any, from_file: Any, default: Any) -> Any:
    """A ``model.*`` key as set, else what the model file says, else the default."""
    if user is not None:
        return user
    return from_file if from_file is not None else default


def config_error(problem: str) -> Exception:
    return ConfigError(f"config: {problem}")


def detector_model_file(settings: Settings) -> tuple[str | None, bool]:
    """:func:`model_file` of a torchvision detector's config, which starts from a model file or from ImageNet
    weights for its backbone (``model.backbone_weights``), not both."""
    path, new_head = starting_model_file(settings)
    if new_head and settings.model.backbone_weights:
        raise config_error("train.init and model.backbone_weights are both set: keep one of them")
    return path, new_head


def existing_model_path(path: str | Path) -> Path:
    """A model file's or folder's path; one line when it is missing or is a file of a DeepForest model folder."""
    path = Path(path)
    if not path.exists():
        raise model_file_error(path, "model file not found")
    if path.is_file() and path.name in FOLDER_FILES:
        raise model_file_error(path, f"give the DeepForest model folder ({path.parent}), not one of its files")
    return path


def check_recorded_architecture(path: Path, cfg: ResNetFPNConfig, found: tuple[str, int, int]) -> None:
    """One line when a rasterscale model file's recorded (backbone, classes, FPN channels) are not its weights'."""
    backbone, classes, fpn_channels = found
    if found != (cfg.backbone, len(cfg.labels), cfg.fpn_channels):
        raise model_file_error(
            path,
            f"records {cfg.backbone} with {len(cfg.labels)} classes and FPN {cfg.fpn_channels}, weights are "
            f"{backbone}/{classes}/{fpn_channels}",
        )


@dataclass(frozen=True)
class DetectorHeader:
    """What a torchvision detector's model file says about itself, whatever the task (``None``: the file does not
    say). ``kind``: rasterscale model file, DeepForest folder, DeepForest Lightning checkpoint or state dict."""

    path: str
    kind: str
    backbone: str
    num_classes: int  # the objects' classes, without torchvision's background
    labels: tuple[str, ...] | None = None
    score_threshold: float | None = None
    nms_threshold: float | None = None
    detections_per_tile: int | None = None
    resize: Resize = None
    patch_size: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    fpn_channels: int = DEFAULT_FPN_CHANNELS  # from the weights
    input: InputBands = field(default_factory=InputBands)  # what it records (DeepForest's: RGB, scaled)

    @property
    def is_deepforest(self) -> bool:
        return self.kind.startswith("DeepForest")

    def describe(self) -> str:
        """The file, its kind, backbone and classes, for the logs."""
        labels = ", ".join(self.labels) if self.labels else f"{self.num_classes} unnamed class(es)"
        return f"{self.path} ({self.kind}, {self.backbone}, {labels})"

    @classmethod
    def of_model_file(
        cls, path: Path, cfg: ResNetFPNConfig, found: tuple[str, int, int], meta: dict[str, Any], **extra: Any
    ) -> Self:
        """The header of a rasterscale model file: what it records (``cfg``), which must be its weights'
        architecture ``found`` (backbone, classes, FPN channels)."""
        check_recorded_architecture(path, cfg, found)
        backbone, classes, fpn_channels = found
        return cls(
            str(path),
            "rasterscale model file",
            backbone,
            classes,
            cfg.labels,
            cfg.score_threshold,
            cfg.nms_threshold,
            cfg.detections_per_tile,
            cfg.resize,
            cfg.patch_size,
            meta,
            fpn_channels,
            cfg.input,
            **extra,
        )

    @classmethod
    def of_hub_folder(
        cls, path: Path, folder: HubFolder, found: tuple[str, int, int], detections_key: str, **extra: Any
    ) -> Self:
        """The header of a DeepForest model folder: its ``config.json`` (``detections_key``: its model's name for
        the detections per image) over its weights' architecture ``found`` (backbone, classes, FPN channels)."""
        backbone, classes, fpn_channels = found
        config = folder.config
        if config.get("num_classes", classes) != classes:
            raise model_file_error(
                path / "config.json", f"num_classes {config['num_classes']} but the weights have {classes} classes"
            )
        label_dict = config.get("label_dict")
        return cls(
            path=str(path),
            kind="DeepForest folder",
            backbone=backbone,
            num_classes=classes,
            labels=labels_from_dict(path / "config.json", label_dict, classes) if label_dict else None,
            score_threshold=config.get("score_thresh"),
            nms_threshold=config.get("nms_thresh"),
            detections_per_tile=config.get(detections_key),
            resize=folder_resize(folder),
            patch_size=folder.ours.get("patch_size"),
            fpn_channels=fpn_channels,
            input=InputBands.from_dict(folder.ours.get("input")),
            **extra,
        )

    def keeps_class_head(self, labels: tuple[str, ...]) -> bool:
        """Whether a model of ``labels`` keeps this file's class layers (the same classes, or unnamed ones as many)."""
        return self.num_classes == len(labels) and (self.labels is None or same_classes(self.labels, labels))


def resolve_detector_keys(
    settings: Settings | None, header: DetectorHeader | None, new_head: bool, model_class: type[ResNetFPNConfig]
) -> dict[str, Any]:
    """The effective settings a torchvision detector of any task has (backbone, labels, patch_size, resize,
    fpn_channels, score_threshold, nms_threshold, detections_per_tile): each ``model.*`` key the user set, else
    what the model file says, else ``model_class``'s default. ``new_head``: the file is a starting point
    (``train.init``), so other labels replace its class head; otherwise (prediction) the labels must number the
    file's classes. A key that contradicts the file's architecture or classes: one-line :class:`ConfigError`.
    ``settings`` None: no key set (a model file's own model, ``header`` given)."""
    model = settings.model if settings is not None else None
    defaults: dict[str, Any] = {f.name: f.default for f in fields(model_class)}
    backbone, fpn_channels = (model.backbone, model.fpn_channels) if model else (None, None)
    if header and backbone not in (None, header.backbone):
        raise config_error(
            f"key 'model.backbone' is {backbone} but {header.path} is a {header.backbone}: "
            "leave model.backbone out to use the file's"
        )
    if header and fpn_channels not in (None, header.fpn_channels):
        raise config_error(
            f"key 'model.fpn_channels' is {fpn_channels} but {header.path} has a "
            f"{header.fpn_channels}-channel feature pyramid: leave model.fpn_channels out to use the file's"
        )
    labels = resolve_labels(model.labels if model else None, header, new_head, tuple(defaults["labels"]))
    resize = configured_resize(model.resize if model else None)
    if resize is None:
        resize = header.resize if header else None
    patch_size = settings.tiling.patch_size if settings is not None else (header and header.patch_size)
    return {
        "backbone": pick(backbone, header and header.backbone, defaults["backbone"]),
        "fpn_channels": pick(fpn_channels, header and header.fpn_channels, defaults["fpn_channels"]),
        "score_threshold": pick(
            model and model.score_threshold, header and header.score_threshold, defaults["score_threshold"]
        ),
        "nms_threshold": pick(
            model and model.nms_threshold, header and header.nms_threshold, defaults["nms_threshold"]
        ),
        "detections_per_tile": pick(
            model and model.detections_per_tile, header and header.detections_per_tile, defaults["detections_per_tile"]
        ),
        "labels": labels,
        "patch_size": patch_size or defaults["patch_size"],
        "resize": None if resize == "native" else resize,
        "input": detector_input(settings, header, new_head),
    }


def resolve_labels(
    labels: tuple[str, ...] | None, header: DetectorHeader | None, new_head: bool, default: tuple[str, ...]
) -> tuple[str, ...]:
    """``model.labels`` (``labels``) as set, else the model file's names, else ``default``; labels that do not
    number or name the file's classes when predicting with it (not ``new_head``): one-line :class:`ConfigError`."""
    if not labels:
        labels = header.labels if header and header.labels else None
    if labels is None:
        labels = default
        if header and header.num_classes != len(labels):
            raise config_error(
                f"{header.path} has {header.num_classes} classes and no names for them: set model.labels"
            )
    if header and not new_head and len(labels) != header.num_classes:
        raise config_error(
            f"key 'model.labels' names {len(labels)} classes but {header.path} has {header.num_classes}"
            f"{': ' + ', '.join(header.labels) if header.labels else ''}"
        )
    if header and not new_head and header.labels and not same_classes(labels, header.labels):
        raise config_error(
            f"key 'model.labels' is [{', '.join(labels)}] but {header.path} predicts [{', '.join(header.labels)}]: "
            "leave model.labels out to use the file's (to train other classes, give the file as train.init)"
        )
    return labels


def detector_input(settings: Settings | None, header: DetectorHeader | None, new_head: bool) -> InputBands:
    """The input bands of a detector (:func:`~rasterscale.tasks.modelinput.model_input`); ``settings`` None: the
    model file's (none: RGB, scaled)."""
    recorded = header.input if header else None
    if settings is None:
        return recorded if recorded is not None else InputBands()
    return model_input(settings, recorded, predicting=header is not None and not new_head)


@dataclass(frozen=True)
class HubFolder:
    """A DeepForest model folder as ``save_pretrained`` writes it: its ``config.json``, the shape of each tensor of
    its ``model.safetensors`` and what rasterscale wrote into the safetensors metadata (:data:`SAFETENSORS_KEY`)."""

    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    ours: dict[str, Any]


def read_hub_folder(path: Path) -> HubFolder:
    """A model folder's config and tensor shapes, without torch (safetensors' header only); one-line InputError
    naming the folder or file when a file is missing or unreadable."""
    from safetensors import SafetensorError, safe_open

    missing = [name for name in FOLDER_FILES if not (path / name).is_file()]
    if missing:
        raise InputError(
            f"{path}: a DeepForest model folder needs {' and '.join(FOLDER_FILES)}; missing {', '.join(missing)}"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: unreadable DeepForest model folder ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path / 'config.json'}: not a DeepForest model configuration (a JSON object)")
    try:
        with safe_open(str(path / "model.safetensors"), framework="numpy") as handle:
            shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
            metadata = handle.metadata() or {}
    except (OSError, ValueError, SafetensorError) as err:  # a file cut short: "incomplete metadata, ..."
        problem = f"unreadable weights ({str(err).splitlines()[0]}); copy or download them again"
        raise InputError(f"{path / 'model.safetensors'}: {problem}") from None
    return HubFolder(config, shapes, json.loads(metadata.get(SAFETENSORS_KEY, "{}")))


def folder_resize(folder: HubFolder) -> Resize:
    """A model folder's input scale: what rasterscale recorded, else ``min_size``/``max_size`` in its config, else
    torchvision's default resize, which DeepForest's models were trained through."""
    if "resize" in folder.ours:
        return tuple(folder.ours["resize"]) if folder.ours["resize"] else None
    config = folder.config
    return config.get("min_size", DEEPFOREST_RESIZE[0]), config.get("max_size", DEEPFOREST_RESIZE[1])


def hub_config(cfg: ResNetFPNConfig, detections_key: str) -> dict[str, Any]:
    """``config.json`` of a DeepForest model folder: the keys its model classes take (``detections_key``: the
    torchvision model's name for the detections per image), with ``min_size``/``max_size`` for the input scale (a
    native-scale model: the patch size, so DeepForest's patches are not resampled)."""
    min_size, max_size = cfg.resize or (cfg.patch_size, cfg.patch_size)
    return {
        "label_dict": {name: index for index, name in enumerate(cfg.labels)},
        "num_classes": len(cfg.labels),
        "score_thresh": cfg.score_threshold,
        "nms_thresh": cfg.nms_threshold,
        detections_key: cfg.detections_per_tile,
        "min_size": min_size,
        "max_size": max_size,
    }


def hub_metadata(cfg: ResNetFPNConfig) -> dict[str, Any]:
    """What ``config.json`` cannot hold for DeepForest (backbone, native scale, patch size, input bands): the
    safetensors metadata of rasterscale's model folders."""
    return {
        "backbone": cfg.backbone,
        "resize": list(cfg.resize) if cfg.resize else None,
        "patch_size": cfg.patch_size,
        "input": cfg.input.to_dict(),
    }


def write_hub_folder(
    folder: str | Path, cfg: ResNetFPNConfig, detections_key: str, state_dict: Mapping[str, Any], **ours: Any
) -> Path:
    """Write a model as a DeepForest model folder, ``folder/config.json`` (:func:`hub_config`) +
    ``folder/model.safetensors``, atomically (a temporary folder beside it, renamed). Keys are torchvision's without
    prefix, as DeepForest writes them; batch-norm step counters are left out, like DeepForest's released weights
    (trained with frozen batch norms). What config.json cannot hold for DeepForest (:func:`hub_metadata` and the
    task's ``ours``) goes into the safetensors metadata (:data:`SAFETENSORS_KEY`)."""
    from safetensors.torch import save_file

    config = hub_config(cfg, detections_key)
    metadata = {"format": "pt", SAFETENSORS_KEY: json.dumps({**hub_metadata(cfg), **ours})}
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if not k.endswith("num_batches_tracked")}
    with atomic_folder(folder) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
    return Path(folder)


def read_payload(path: Path, not_a_model: str) -> Any:
    """A torch-saved file's payload (torch imported: :func:`rasterscale.tasks.modelfiles.torch_payload`); one line
    naming the file and the formats its task reads (``not_a_model``) otherwise."""
    try:
        return torch_payload(path)
    except NotATorchFile:
        raise model_file_error(path, not_a_model) from None


Header = TypeVar("Header", bound="DetectorHeader")
Config = TypeVar("Config", bound="ResNetFPNConfig")


def effective_model(
    settings: Settings,
    read_header: Callable[[str], Header],
    resolve: Callable[[Settings, Header | None, bool], Config],
) -> tuple[Config, Header | None]:
    """The effective model of a validated config (``resolve``: each ``model.*`` key over the file's header), reading
    the header of the model file it names (``model.file``, else ``train.init``: :func:`detector_model_file`)."""
    path, new_head = detector_model_file(settings)
    header = read_header(path) if path else None
    return resolve(settings, header, new_head), header
