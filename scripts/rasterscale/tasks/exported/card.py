"""A model card (torch-free): what an exported model file does not say about itself, read from ``<file>.yaml``
beside it or from ``model.card`` in the config.

.. code-block:: yaml

    task: segmentation          # segmentation | regression | points
    labels: [background, tree]  # class names (segmentation) or value names (regression), in output-channel order
    bands: [red, green, blue]   # the input bands in channel order (count = the file's input channels)
    input: scaled               # scaled: tiles as 0-255 / 255, in [0, 1] (default) | raw: band values as float32
    normalize: {mean: [..], std: [..]}  # optional: applied by rasterscale first; leave out when the file
                                # normalizes itself (it then takes [0, 1] or raw values as they are)
    tile_size: 256              # the tile size the file takes, or any
    output: logits              # logits | probabilities (segmentation) | values (regression) | heatmap (points)
    output_stride: 1            # input pixels per output pixel, when the output is coarser than the input

A file is exported (not a rasterscale ``.pt`` payload) when it ends in ``.onnx`` or ``.pt2``, or when it has a card:
a TorchScript file (``torch.jit.save``) is any other name with a card. Exported files predict only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rasterscale.errors import InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import ModelSettings

FORMS = ("onnx", "torch.export", "torchscript")
SUFFIX_FORMS = {".onnx": "onnx", ".pt2": "torch.export"}
CARD_KEYS = ("task", "labels", "bands", "input", "normalize", "tile_size", "output", "output_stride")
REQUIRED_KEYS = ("task", "labels", "bands", "output")


@dataclass(frozen=True)
class ModelCard:
    """An exported model file and what its card declares: ``form`` (onnx, torch.export, torchscript), the task,
    ``labels`` (one per output channel), the ``input`` bands and normalization, ``tile_size`` (None: any), the
    ``output`` layout and ``output_stride``. ``source``: where the card was read (for messages)."""

    path: str
    form: str
    task: str
    labels: tuple[str, ...]
    input: InputBands
    tile_size: int | None
    output: str
    output_stride: int = 1
    source: str = ""
    patch_size: int = 0  # the tiles the workflow cuts (tiling.patch_size, else the card's tile_size)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def outputs(self) -> int:
        return len(self.labels)

    def expected_output(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        """The output shape the card promises for a batch of tiles of this size."""
        return (batch, len(self.labels), height // self.output_stride, width // self.output_stride)

    def describe(self) -> str:
        """One line for the logs."""
        size = "any tile size" if self.tile_size is None else f"{self.tile_size} px tiles"
        stride = f" at stride {self.output_stride}" if self.output_stride != 1 else ""
        return (
            f"exported {self.form} file, {self.task}: {self.output}{stride} of [{', '.join(self.labels)}], {size}; "
            f"{self.input.describe()} (card: {self.source})"
        )


def card_path(model_file: str | Path) -> Path:
    """Where a model file's card lies: ``<file>.yaml`` beside it."""
    return Path(f"{model_file}.yaml")


def form_of(path: str | Path) -> str:
    """The exported form a file's name says (``.onnx``, ``.pt2``), else TorchScript (a card marks it exported)."""
    return SUFFIX_FORMS.get(Path(path).suffix.lower(), "torchscript")


def is_exported(path: str | Path, model: ModelSettings) -> bool:
    """Whether ``path`` is an exported model: its suffix says so, a card lies beside it, or ``model.card`` is set."""
    return Path(path).suffix.lower() in SUFFIX_FORMS or bool(model.card) or card_path(path).is_file()


def card_error(source: str, problem: str) -> InputError:
    return InputError(f"{source}: {problem}")


def read_card_mapping(path: str | Path, model: ModelSettings) -> tuple[dict[str, Any], str]:
    """The card's keys and where they came from: ``model.card`` in the config, else ``<file>.yaml``. Both, or
    neither: one line naming the file."""
    beside = card_path(path)
    given = model.card
    if given and beside.is_file():
        raise card_error(str(beside), "a card beside the model file and model.card in the config: keep one")
    if given:
        return dict(given), "model.card"
    if not beside.is_file():
        raise card_error(
            str(path),
            f"an exported {form_of(path)} model needs a model card: write {beside.name} beside it (task, labels, "
            "bands, output; see docs/models.md) or set model.card",
        )
    try:
        data = yaml.safe_load(beside.read_text())
    except yaml.YAMLError as err:
        raise card_error(str(beside), f"not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, Mapping):
        raise card_error(str(beside), "a model card is a mapping of task, labels, bands, output...")
    return dict(data), str(beside)


def names(data: Mapping[str, Any], key: str, source: str) -> tuple[str, ...]:
    value = data[key]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise card_error(source, f"key '{key}' must be a list of names, got {value!r}")
    if len({v.casefold() for v in value}) != len(value):
        raise card_error(source, f"key '{key}' repeats a name: {value}")
    return tuple(value)


def card_input(data: Mapping[str, Any], source: str) -> InputBands:
    """The bands and normalization of a card: ``normalize`` left out means none (mean 0, std 1)."""
    bands = names(data, "bands", source)
    how = data.get("input", "scaled")
    if how not in ("scaled", "raw"):
        raise card_error(source, f"key 'input' is {how!r} (scaled or raw)")
    normalize = data.get("normalize")
    if normalize is None:
        mean, std = (0.0,) * len(bands), (1.0,) * len(bands)
    else:
        if not isinstance(normalize, Mapping) or set(normalize) != {"mean", "std"}:
            raise card_error(source, f"key 'normalize' must be {{mean: [..], std: [..]}}, got {normalize!r}")
        mean, std = tuple(normalize["mean"]), tuple(normalize["std"])
    try:
        return InputBands(bands, tuple(float(m) for m in mean), tuple(float(s) for s in std), raw=how == "raw")
    except (TypeError, ValueError) as err:
        raise card_error(source, f"key 'normalize': {err}") from None


def positive_int(data: Mapping[str, Any], key: str, source: str, default: int | None) -> int | None:
    value = data.get(key, default)
    if value is None or value == "any":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise card_error(source, f"key '{key}' must be a positive integer{' or any' if key == 'tile_size' else ''}")
    return value


@dataclass(frozen=True)
class CardRules:
    """What a task accepts of a card: its name, the ``outputs`` layouts it takes and its fewest labels."""

    task: str
    outputs: tuple[str, ...]
    min_labels: int = 1


def read_card(path: str | Path, model: ModelSettings, rules: CardRules, patch_size: int | None) -> ModelCard:
    """The card of exported model file ``path`` for a task (``rules``), checked key by key (one line naming the
    card and the key). ``patch_size``: ``tiling.patch_size`` (None: the card's tile size); a fixed tile size must
    equal it."""
    task = rules.task
    if not Path(path).is_file():
        raise card_error(str(path), f"{task} model file not found")
    data, source = read_card_mapping(path, model)
    unknown = sorted(set(data) - set(CARD_KEYS))
    if unknown:
        raise card_error(source, f"unknown key(s) {', '.join(unknown)} (a card has {', '.join(CARD_KEYS)})")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise card_error(source, f"missing key(s) {', '.join(missing)}")
    if data["task"] != task:
        raise card_error(source, f"the card is for task {data['task']!r}, but the config's task is {task}")
    output = data["output"]
    if output not in rules.outputs:
        raise card_error(source, f"key 'output' is {output!r}; a {task} model gives {' or '.join(rules.outputs)}")
    labels = names(data, "labels", source)
    if len(labels) < rules.min_labels:
        raise card_error(source, f"key 'labels': a {task} model gives at least {rules.min_labels}, got {list(labels)}")
    tile_size = positive_int(data, "tile_size", source, None)
    stride = positive_int(data, "output_stride", source, 1) or 1
    if patch_size and tile_size and patch_size != tile_size:
        raise card_error(
            source, f"the file takes {tile_size} px tiles but tiling.patch_size is {patch_size}: set it to {tile_size}"
        )
    size = int(patch_size or tile_size or 0)
    if not size:
        raise card_error(source, "tile_size is any: set tiling.patch_size")
    if size % stride:
        raise card_error(source, f"tiles of {size} px are not a multiple of output_stride {stride}")
    return ModelCard(
        str(path), form_of(path), task, labels, card_input(data, source), tile_size, output, stride, source, size
    )
