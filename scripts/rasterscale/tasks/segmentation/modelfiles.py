"""Segmenter files without torch: what a segmenter is (:class:`SegmenterConfig`), what a file records and what a
config asks for (:func:`segmenter_of_config`), read at dry run. A file's payload is read with torch only when there
is a file to read; the network itself lives in :mod:`rasterscale.tasks.segmentation.model`.

A segmenter file (``.pt``) is ``torch.save`` of ``{"format": SEGMENTER_FORMAT, "task": "segmentation", "model":
config, "state_dict": weights, "meta": training figures}``. Anything else is refused with one line naming the file
(another task's model, a DeepForest folder: "..., but task is segmentation").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasterscale.errors import InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import Settings
from rasterscale.tasks.encoders import (
    ARCHITECTURES,
    DEFAULT_ARCHITECTURE,
    DEFAULT_ENCODER,
    UNET_DECODER,
    checked_encoder_weights,
    default_decoder,
    dense_network,
)
from rasterscale.tasks.modelfiles import payload_config, smp_config_dict, smp_fields, starting_model_file, task_payload
from rasterscale.tasks.modelinput import model_input

__all__ = ["ARCHITECTURES", "UNET_DECODER", "SegmenterConfig", "segmenter_of_config"]

SEGMENTER_FORMAT = "rasterscale-segmenter/1"
NOT_A_SEGMENTER = f"not a rasterscale segmenter (a .pt file of format {SEGMENTER_FORMAT})"


@dataclass(frozen=True)
class SegmenterConfig:
    """What builds a segmenter: an smp ``architecture`` on ``encoder`` (a name of
    :mod:`rasterscale.tasks.encoders`, resolved). ``decoder_channels`` None: the architecture's default
    (:data:`UNET_DECODER` for a U-Net, smp's otherwise); ``input``: the bands it takes (a file that records none:
    RGB, scaled)."""

    labels: tuple[str, ...]
    architecture: str = DEFAULT_ARCHITECTURE
    encoder: str = DEFAULT_ENCODER
    patch_size: int = 400
    decoder_channels: tuple[int, ...] | None = None
    input: InputBands = field(default_factory=InputBands)

    def __post_init__(self) -> None:
        if len(self.labels) < 2:
            raise ValueError(f"a segmenter needs at least 2 classes, got labels {list(self.labels)}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r} (one of {', '.join(ARCHITECTURES)})")
        if self.decoder_channels is None:
            object.__setattr__(self, "decoder_channels", default_decoder(self.architecture))

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def to_dict(self) -> dict[str, Any]:
        return smp_config_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SegmenterConfig:
        """A file's record."""
        return cls(**smp_fields(data))

    def describe(self) -> str:
        """One line for the logs."""
        decoder = f", decoder {list(self.decoder_channels)}" if self.decoder_channels else ""
        return (
            f"{self.architecture} on {self.encoder}{decoder}, {self.num_classes} classes "
            f"({', '.join(self.labels)}), {self.patch_size} px tiles"
        ) + ("" if self.input.is_default else f", {self.input.describe()}")


def segmenter_payload(path: str | Path) -> dict[str, Any]:
    """The payload of a segmenter file (tensors memory-mapped); one-line InputError naming the file otherwise."""
    return task_payload(path, "segmentation", SEGMENTER_FORMAT, NOT_A_SEGMENTER)


def config_of_payload(path: str | Path, payload: Mapping[str, Any]) -> SegmenterConfig:
    return payload_config(path, payload, SegmenterConfig.from_dict, "segmenter")


def read_segmenter_header(path: str | Path) -> SegmenterConfig:
    """The configuration a segmenter file records (its weights are memory-mapped, not read)."""
    return config_of_payload(path, segmenter_payload(path))


DEFAULT_LABELS = ("background", "tree")


def segmenter_of_config(settings: Settings) -> SegmenterConfig:
    """The effective segmenter of a validated config: each ``model.*`` key set, else what the model file
    (``model.file``, else ``train.init``) records, else the defaults (labels background, tree; a U-Net on
    ResNet-18); tiles of ``tiling.patch_size``. A file that is not a segmenter, or whose classes or network the
    config's keys contradict, and encoder weights that cannot start the network
    (:func:`~rasterscale.tasks.encoders.checked_encoder_weights`) raise a one-line error naming it (at dry run)."""
    model = settings.model
    path, new_head = starting_model_file(settings)
    header = read_segmenter_header(path) if path else None
    labels = tuple(model.labels or (header.labels if header else DEFAULT_LABELS))
    if header is not None and len(labels) != header.num_classes:
        raise InputError(
            f"{path}: model.labels names {len(labels)} classes but the segmenter has {header.num_classes} "
            f"({', '.join(header.labels)})"
        )
    if header is not None and not new_head and [x.casefold() for x in labels] != [x.casefold() for x in header.labels]:
        raise InputError(
            f"{path}: the segmenter predicts [{', '.join(header.labels)}] but model.labels is [{', '.join(labels)}]; "
            "leave model.labels out to use the file's"
        )
    if len(labels) < 2:
        raise InputError(f"model.labels: a segmenter needs at least 2 classes (e.g. [background, tree]), got {labels}")
    recorded = (header.architecture, header.encoder) if header else None
    architecture, encoder = dense_network(model, path, recorded, "segmentation")
    patch_size = settings.tiling.patch_size
    decoder = header.decoder_channels if header else None
    bands = model_input(settings, header.input if header else None, predicting=header is not None and not new_head)
    checked_encoder_weights(model, path, new_head, bands.count)
    return SegmenterConfig(labels, architecture, encoder, int(patch_size), decoder, bands)
