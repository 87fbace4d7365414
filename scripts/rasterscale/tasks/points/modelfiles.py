"""Point models without torch: what a point model is (:class:`PointsConfig`), what a file records and what a config
asks for (:func:`points_of_config`), read at dry run. The network itself lives in
:mod:`rasterscale.tasks.points.model`.

A point model file (``.pt``) is ``torch.save`` of ``{"format": POINTS_FORMAT, "task": "points", "model": config,
"state_dict": weights, "meta": training figures}``. Anything else is refused with one line naming the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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
from rasterscale.tasks.exported.card import ModelCard
from rasterscale.tasks.modelfiles import payload_config, smp_config_dict, smp_fields, starting_model_file, task_payload
from rasterscale.tasks.modelinput import model_input

POINTS_FORMAT = "rasterscale-points/1"
LOSSES: tuple[str, ...] = ("focal", "mse")  # the schema's model.loss takes them from here (with regression's)
DEFAULT_LOSS = "focal"
DEFAULT_LABELS = ("tree",)
DEFAULT_SIGMA = 0.5  # metres: a Gaussian of this sigma around each true point is the heatmap's target
DEFAULT_SCORE_THRESHOLD = 0.3
PEAK_SIGMAS = 2.0  # two peaks of one class nearer than this many sigmas are one (a Gaussian has no second peak)
DEFAULT_POINTS_PER_TILE = 1000
NOT_A_POINT_MODEL = f"not a rasterscale point model (a .pt file of format {POINTS_FORMAT})"


@dataclass(frozen=True)
class PointsConfig:
    """What builds a point model: an smp ``architecture`` (a U-Net by default) on ``encoder`` with one heatmap
    channel per class of ``labels``, trained with ``loss`` (``focal``: CenterNet's penalty-reduced focal loss;
    ``mse``) against a Gaussian of ``sigma`` metres around each true point; a peak of the heatmap scoring at least
    ``score_threshold`` is a point, at most ``points_per_tile`` a tile; ``input``: the bands it takes."""

    labels: tuple[str, ...] = DEFAULT_LABELS
    encoder: str = DEFAULT_ENCODER
    patch_size: int = 400
    decoder_channels: tuple[int, ...] | None = None
    loss: str = DEFAULT_LOSS
    input: InputBands = field(default_factory=InputBands)
    architecture: str = DEFAULT_ARCHITECTURE
    sigma: float = DEFAULT_SIGMA
    score_threshold: float = DEFAULT_SCORE_THRESHOLD
    points_per_tile: int = DEFAULT_POINTS_PER_TILE

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r} (one of {', '.join(ARCHITECTURES)})")
        if self.decoder_channels is None:
            object.__setattr__(self, "decoder_channels", default_decoder(self.architecture))
        if not self.labels:
            raise ValueError("a point model finds at least one class (model.labels)")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r} (one of {', '.join(LOSSES)})")
        if not self.sigma > 0:
            raise ValueError(f"sigma {self.sigma} must be positive")
        if not 0 <= self.score_threshold <= 1 or self.points_per_tile < 1:
            raise ValueError(f"score threshold {self.score_threshold} or points per tile {self.points_per_tile}")

    @property
    def outputs(self) -> int:
        return len(self.labels)

    def to_dict(self) -> dict[str, Any]:
        return smp_config_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PointsConfig:
        """A file's record."""
        return cls(**smp_fields(data))

    def describe(self) -> str:
        """One line for the logs."""
        decoder = f", decoder {list(self.decoder_channels)}" if self.decoder_channels else ""
        return (
            f"{self.architecture} on {self.encoder}{decoder}, a heatmap of {self.outputs} class(es) "
            f"({', '.join(self.labels)}), sigma {self.sigma:g} m, loss {self.loss}, peaks of score >= "
            f"{self.score_threshold:g} (at most {self.points_per_tile} a tile), {self.patch_size} px tiles, "
            f"{self.input.describe()}"
        )


def points_payload(path: str | Path) -> dict[str, Any]:
    """The payload of a point model file (tensors memory-mapped); one-line InputError naming the file otherwise."""
    return task_payload(path, "points", POINTS_FORMAT, NOT_A_POINT_MODEL)


def config_of_payload(path: str | Path, payload: Mapping[str, Any]) -> PointsConfig:
    return payload_config(path, payload, PointsConfig.from_dict, "point model")


def read_points_header(path: str | Path) -> PointsConfig:
    """The configuration a point model file records (its weights are memory-mapped, not read)."""
    return config_of_payload(path, points_payload(path))


def with_prediction_keys(cfg: PointsConfig, settings: Settings) -> PointsConfig:
    """A file's configuration with the keys that apply at prediction as the config sets them
    (``model.score_threshold``, ``model.detections_per_tile``)."""
    model = settings.model
    return replace(
        cfg,
        score_threshold=cfg.score_threshold if model.score_threshold is None else model.score_threshold,
        points_per_tile=cfg.points_per_tile if model.detections_per_tile is None else model.detections_per_tile,
    )


def peak_window(distance_m: float, pixel_size: float) -> int:
    """The max-pool window (odd, at least 3 px) within which two peaks are one: ``distance_m`` either side (a
    distance of a whole number of pixels, as 0.3 m of 0.1 m pixels, is that number despite float rounding)."""
    return 2 * max(1, math.floor(distance_m / pixel_size + 1e-9)) + 1


@dataclass(frozen=True)
class PeakRule:
    """How a prediction decodes its heatmaps: a peak is the highest pixel of its ``window`` (px, odd) scoring at
    least ``threshold``, at most ``top_k`` a tile."""

    window: int
    threshold: float
    top_k: int


def peak_rule(model_cfg: PointsConfig | ModelCard, settings: Settings, pixel_size: float) -> PeakRule:
    """The peak rule of a prediction on pixels of ``pixel_size`` (the CRS's units): the window spans
    :data:`PEAK_SIGMAS` sigmas either side (at least a pixel); sigma, the threshold and the points per tile are a
    point model file's (the config's keys over the last two: :func:`with_prediction_keys`), or for an exported model
    the config's keys (``model.sigma``, ...), else the defaults. The merge removes what is left of duplicates
    within ``merge.point_distance``."""
    if isinstance(model_cfg, PointsConfig):
        window = peak_window(PEAK_SIGMAS * model_cfg.sigma, pixel_size)
        return PeakRule(window, model_cfg.score_threshold, model_cfg.points_per_tile)
    model = settings.model
    window = peak_window(PEAK_SIGMAS * (DEFAULT_SIGMA if model.sigma is None else model.sigma), pixel_size)
    threshold = DEFAULT_SCORE_THRESHOLD if model.score_threshold is None else model.score_threshold
    top_k = DEFAULT_POINTS_PER_TILE if model.detections_per_tile is None else model.detections_per_tile
    return PeakRule(window, float(threshold), int(top_k))


def _pick(value: Any, recorded: Any, default: Any) -> Any:
    return value if value is not None else (recorded if recorded is not None else default)


def points_of_config(settings: Settings) -> PointsConfig:
    """The effective point model of a validated config: each ``model.*`` key set, else what the model file
    (``model.file``, else ``train.init``) records, else the defaults (one class, ``tree``; a U-Net on ResNet-18;
    focal loss, sigma 0.5 m); tiles of ``tiling.patch_size``. Predicting with a file, its classes, network and
    sigma are the file's: keys that contradict them fail with one line naming the file (at dry run)."""
    model = settings.model
    path, new_head = starting_model_file(settings)
    header = read_points_header(path) if path else None
    predicting = header is not None and not new_head
    labels = tuple(model.labels or (header.labels if header else DEFAULT_LABELS))
    if predicting and header is not None and [x.casefold() for x in labels] != [x.casefold() for x in header.labels]:
        raise InputError(
            f"{path}: the point model finds [{', '.join(header.labels)}] but model.labels is [{', '.join(labels)}]; "
            "leave model.labels out to use the file's"
        )
    recorded = (header.architecture, header.encoder) if header else None
    architecture, encoder = dense_network(model, path, recorded, "points")
    loss = _pick(model.loss, header.loss if header else None, DEFAULT_LOSS)
    if loss not in LOSSES:
        raise ConfigError(f"config: key 'model.loss' is {loss!r}; points takes {' or '.join(LOSSES)}")
    sigma = float(_pick(model.sigma, header.sigma if header else None, DEFAULT_SIGMA))
    if predicting and header is not None and (loss != header.loss or sigma != header.sigma):
        raise ConfigError(
            f"config: keys 'model.loss' and 'model.sigma' apply to training only, and {path} was trained with loss "
            f"{header.loss}, sigma {header.sigma:g} m: leave them out (or give the file as train.init to train on)"
        )
    threshold = float(_pick(model.score_threshold, header.score_threshold if header else None, DEFAULT_SCORE_THRESHOLD))
    per_tile = int(
        _pick(model.detections_per_tile, header.points_per_tile if header else None, DEFAULT_POINTS_PER_TILE)
    )
    bands = model_input(settings, header.input if header else None, predicting=predicting)
    checked_encoder_weights(model, path, new_head, bands.count)
    decoder = header.decoder_channels if header else None
    return PointsConfig(
        labels,
        encoder,
        int(settings.tiling.patch_size),
        decoder,
        loss,
        bands,
        architecture,
        sigma,
        threshold,
        per_tile,
    )
