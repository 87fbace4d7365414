"""Regressor files without torch: what a regressor is (:class:`RegressorConfig`), what a file records and what a
config asks for (:func:`regressor_of_config`), read at dry run. The network itself lives in
:mod:`rasterscale.tasks.regression.model`.

A regressor file (``.pt``) is ``torch.save`` of ``{"format": REGRESSOR_FORMAT, "task": "regression", "model":
config, "state_dict": weights, "meta": training figures}``; the config records the input bands and the targets'
mean and std (the training tiles', measured when training starts), by which the network's outputs are scaled back
to target units. Anything else is refused with one line naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasterscale.errors import ConfigError, InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import Settings
from rasterscale.tasks.encoders import (
    ARCHITECTURES,
    DEFAULT_ARCHITECTURE,
    DEFAULT_ENCODER,
    checked_encoder_weights,
    default_decoder,
    dense_network,
)
from rasterscale.tasks.modelfiles import payload_config, smp_config_dict, smp_fields, starting_model_file, task_payload
from rasterscale.tasks.modelinput import model_input

REGRESSOR_FORMAT = "rasterscale-regressor/1"
LOSSES: tuple[str, ...] = ("l1", "mse", "huber")  # the schema's model.loss takes them from here
DEFAULT_LOSS = "l1"
DEFAULT_LABELS = ("height",)
NOT_A_REGRESSOR = f"not a rasterscale regressor (a .pt file of format {REGRESSOR_FORMAT})"


@dataclass(frozen=True)
class RegressorConfig:
    """What builds a regressor: an smp ``architecture`` (a U-Net by default) on ``encoder`` (a name of
    :mod:`rasterscale.tasks.encoders`, resolved) with one linear output per ``labels`` (the values it predicts),
    trained with ``loss``; ``decoder_channels`` None: the architecture's default (a U-Net's
    :data:`~rasterscale.tasks.encoders.UNET_DECODER`, smp's otherwise); ``input``: the bands it takes;
    ``target_mean``/``target_std``: per output, the scale of the targets (empty until training measures them: the
    network then predicts the values as they are)."""

    labels: tuple[str, ...] = DEFAULT_LABELS
    encoder: str = DEFAULT_ENCODER
    patch_size: int = 400
    decoder_channels: tuple[int, ...] | None = None
    loss: str = DEFAULT_LOSS
    input: InputBands = field(default_factory=InputBands)
    target_mean: tuple[float, ...] = ()
    target_std: tuple[float, ...] = ()
    architecture: str = DEFAULT_ARCHITECTURE

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r} (one of {', '.join(ARCHITECTURES)})")
        if self.decoder_channels is None:
            object.__setattr__(self, "decoder_channels", default_decoder(self.architecture))
        if not self.labels:
            raise ValueError("a regressor predicts at least one value (model.labels)")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r} (one of {', '.join(LOSSES)})")
        if len(self.target_mean) != len(self.target_std) or len(self.target_mean) not in (0, len(self.labels)):
            raise ValueError(
                f"{len(self.labels)} values but {len(self.target_mean)} target means, {len(self.target_std)} stds"
            )
        if any(not std > 0 for std in self.target_std):
            raise ValueError(f"target std {list(self.target_std)}: each must be positive")

    @property
    def outputs(self) -> int:
        return len(self.labels)

    @property
    def scale(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) per output that the network's outputs are scaled back by (0, 1 before training)."""
        if self.target_mean:
            return self.target_mean, self.target_std
        return (0.0,) * self.outputs, (1.0,) * self.outputs

    def to_dict(self) -> dict[str, Any]:
        return {**smp_config_dict(self), "target_mean": list(self.target_mean), "target_std": list(self.target_std)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegressorConfig:
        """A file's record."""
        fields = smp_fields(data)
        for key in ("target_mean", "target_std"):
            fields[key] = tuple(float(v) for v in fields.get(key) or ())
        return cls(**fields)

    def describe(self) -> str:
        """One line for the logs."""
        mean, std = self.scale
        scale = ", ".join(f"{label} {m:.4g} ± {s:.4g}" for label, m, s in zip(self.labels, mean, std, strict=True))
        targets = f"targets {scale}" if self.target_mean else "targets' scale measured when training starts"
        decoder = f", decoder {list(self.decoder_channels)}" if self.decoder_channels else ""
        return (
            f"{self.architecture} on {self.encoder}{decoder}, {self.outputs} value(s) "
            f"({', '.join(self.labels)}), loss {self.loss}, {targets}, {self.patch_size} px tiles, "
            f"{self.input.describe()}"
        )


def regressor_payload(path: str | Path) -> dict[str, Any]:
    """The payload of a regressor file (tensors memory-mapped); one-line InputError naming the file otherwise."""
    return task_payload(path, "regression", REGRESSOR_FORMAT, NOT_A_REGRESSOR)


def config_of_payload(path: str | Path, payload: Mapping[str, Any]) -> RegressorConfig:
    return payload_config(path, payload, RegressorConfig.from_dict, "regressor")


def read_regressor_header(path: str | Path) -> RegressorConfig:
    """The configuration a regressor file records (its weights are memory-mapped, not read)."""
    return config_of_payload(path, regressor_payload(path))


def regressor_of_config(settings: Settings) -> RegressorConfig:
    """The effective regressor of a validated config: each ``model.*`` key set, else what the model file
    (``model.file``, else ``train.init``) records, else the defaults (one value, ``height``; a U-Net on ResNet-18;
    loss l1); tiles of ``tiling.patch_size``. Predicting with a file, its values, network and target scale are the
    file's: keys that contradict them fail with one line naming the file (at dry run), as do encoder weights that
    cannot start the network (:func:`~rasterscale.tasks.encoders.checked_encoder_weights`)."""
    model = settings.model
    path, new_head = starting_model_file(settings)
    header = read_regressor_header(path) if path else None
    labels = tuple(model.labels or (header.labels if header else DEFAULT_LABELS))
    if header is not None and not new_head and [x.casefold() for x in labels] != [x.casefold() for x in header.labels]:
        raise InputError(
            f"{path}: the regressor predicts [{', '.join(header.labels)}] but model.labels is [{', '.join(labels)}]; "
            "leave model.labels out to use the file's"
        )
    recorded = (header.architecture, header.encoder) if header else None
    architecture, encoder = dense_network(model, path, recorded, "regression")
    loss = model.loss or (header.loss if header else DEFAULT_LOSS)
    if loss not in LOSSES:
        raise ConfigError(f"config: key 'model.loss' is {loss!r} (one of {', '.join(LOSSES)})")
    if header is not None and not new_head and loss != header.loss:
        raise ConfigError(
            f"config: key 'model.loss' is {loss} but {path} was trained with {header.loss}, and a loss applies to "
            "training only: leave it out (or give the file as train.init to train on)"
        )
    patch_size = settings.tiling.patch_size
    decoder = header.decoder_channels if header else None
    bands = model_input(settings, header.input if header else None, predicting=header is not None and not new_head)
    checked_encoder_weights(model, path, new_head, bands.count)
    keeps_scale = header is not None and not new_head  # predicting with the file: its targets' scale
    mean = header.target_mean if keeps_scale and header is not None else ()
    std = header.target_std if keeps_scale and header is not None else ()
    return RegressorConfig(labels, encoder, int(patch_size), decoder, loss, bands, mean, std, architecture)
