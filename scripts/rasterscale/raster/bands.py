"""What a model takes as input (:class:`InputBands`): its bands, by name, how a tile's pixels reach it and the
per-band normalization it applies to them. Torch-free: the plan reads it from a config or a model file's header at
dry run, and every task's model file records it (a file without one is an RGB model of today's kind).

A tile reaches a model in one of two ways:

- **scaled** (the default, and every RGB and DeepForest model): each band is mapped to 0-255 (uint8 as stored, or
  ``scenes.X.scale``), divided by 255 on the device, and normalized by ``mean``/``std`` in those [0, 1] units:
  ImageNet's statistics for the bands named red, green and blue, their averages for any other band;
- **raw** (``normalize`` set): the band values as stored, as float32, normalized by ``mean``/``std`` in the
  raster's own units: given (``{mean: [..], std: [..]}``) or ``auto``, computed once from the training scenes'
  decimated reads (:func:`pooled_statistics` of the statistics each manifest stores) and stored in the model file.

A band's *role* (red, green or blue) is what lets an N-band model start from an RGB checkpoint: the first
convolution keeps the RGB filters for the bands in those roles (:func:`rgb_roles`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rasterscale.errors import ConfigError

# ImageNet's statistics, as torchvision and DeepForest use them, in [0, 1] units (red, green, blue)
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)
RGB_NAMES = ("red", "green", "blue")
# what names a band of each role may carry (compared case-insensitively): its colour, or Sentinel-2's band
ROLE_NAMES = {
    "red": ("red", "r", "b04", "b4"),
    "green": ("green", "g", "b03", "b3"),
    "blue": ("blue", "b", "b02", "b2"),
}
# a scaled band in no RGB role is normalized by ImageNet's averages
OTHER_MEAN = round(sum(IMAGE_MEAN) / 3, 4)
OTHER_STD = round(sum(IMAGE_STD) / 3, 4)
AUTO = "auto"


def default_band_names(count: int) -> tuple[str, ...]:
    """Names of ``count`` bands nobody named: red, green, blue first, then ``band4``, ``band5``...; a 1- or 2-band
    model's are ``band1``.. (no RGB role)."""
    if count < len(RGB_NAMES):
        return tuple(f"band{k + 1}" for k in range(count))
    return (*RGB_NAMES, *(f"band{k + 1}" for k in range(len(RGB_NAMES), count)))


def role_of(name: str) -> str | None:
    """The RGB role a band's name gives it (red, green, blue), or None."""
    folded = name.casefold()
    return next((role for role, names in ROLE_NAMES.items() if folded in names), None)


def rgb_roles(names: Sequence[str]) -> dict[str, int]:
    """Which band (0-based) plays red, green and blue: ``{role: index}`` for the roles present (the first band of
    each role)."""
    found: dict[str, int] = {}
    for index, name in enumerate(names):
        role = role_of(name)
        if role is not None and role not in found:
            found[role] = index
    return found


def scaled_statistics(names: Sequence[str]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and std of scaled bands in [0, 1] units: ImageNet's for the RGB roles, their averages otherwise."""
    mean, std = [], []
    for name in names:
        role = role_of(name)
        k = RGB_NAMES.index(role) if role else -1
        mean.append(IMAGE_MEAN[k] if k >= 0 else OTHER_MEAN)
        std.append(IMAGE_STD[k] if k >= 0 else OTHER_STD)
    return tuple(mean), tuple(std)


@dataclass(frozen=True)
class InputBands:
    """A model's input: its bands' ``names`` (one per band, in the order tiles carry them), whether tiles are
    ``raw`` band values (else scaled to 0-255, then [0, 1]) and the per-band ``mean`` and ``std`` the model
    normalizes by. A raw input whose statistics are still to compute (``normalize: auto`` before training) has
    empty ``mean`` and ``std`` (:attr:`pending`)."""

    names: tuple[str, ...] = RGB_NAMES
    mean: tuple[float, ...] = IMAGE_MEAN
    std: tuple[float, ...] = IMAGE_STD
    raw: bool = False

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a model takes at least one band")
        if len({name.casefold() for name in self.names}) != len(self.names):
            raise ValueError(f"band names repeat: {list(self.names)}")
        if self.pending:
            if not self.raw:
                raise ValueError("only a raw input computes its statistics (normalize: auto)")
            return
        if not len(self.mean) == len(self.std) == len(self.names):
            raise ValueError(f"{len(self.names)} bands but {len(self.mean)} means and {len(self.std)} stds")
        bad = [k for k, s in enumerate(self.std) if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"std of band {self.names[bad[0]]} is {self.std[bad[0]]}: it must be positive")

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def pending(self) -> bool:
        """Raw statistics still to compute from the training scenes (``normalize: auto``)."""
        return not self.mean and not self.std

    @property
    def is_default(self) -> bool:
        """Today's (and DeepForest's) input: three scaled bands, red, green, blue, ImageNet's statistics."""
        return self == InputBands()

    def with_statistics(self, mean: Sequence[float], std: Sequence[float]) -> InputBands:
        return InputBands(self.names, tuple(float(m) for m in mean), tuple(float(s) for s in std), self.raw)

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "mean": list(self.mean), "std": list(self.std), "raw": self.raw}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> InputBands:
        """A model file's record; None (a file written before models recorded their bands): RGB, scaled."""
        if not data:
            return cls()
        return cls(
            tuple(str(n) for n in data["names"]),
            tuple(float(m) for m in data.get("mean", ())),
            tuple(float(s) for s in data.get("std", ())),
            bool(data.get("raw", False)),
        )

    def describe(self) -> str:
        """One line for the logs: the bands, how they reach the model, the statistics."""
        how = "raw values" if self.raw else "scaled to 0-255"
        if self.pending:
            stats = "statistics computed from the training scenes (normalize: auto)"
        else:
            stats = "mean " + _numbers(self.mean) + ", std " + _numbers(self.std)
        return f"{self.count} band(s) [{', '.join(self.names)}], {how}, {stats}"


def _numbers(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def scaled_input(names: Sequence[str]) -> InputBands:
    """A scaled input of these bands with its default statistics."""
    mean, std = scaled_statistics(names)
    return InputBands(tuple(names), mean, std, raw=False)


def check_normalize(value: Any, count: int, key: str) -> None:
    """A ``normalize`` key (``auto`` or ``{mean, std}``) for ``count`` bands: one line naming ``key`` otherwise."""
    if value is None or value == AUTO:
        return
    for name in ("mean", "std"):
        values = value[name]
        if len(values) != count:
            raise ConfigError(f"config: key '{key}.{name}' has {len(values)} value(s) for {count} band(s)")
    bad = [k for k, s in enumerate(value["std"]) if not (math.isfinite(float(s)) and float(s) > 0)]
    if bad:
        raise ConfigError(
            f"config: key '{key}.std' is {value['std'][bad[0]]} for band {bad[0] + 1}: a std must be positive"
        )


def input_of_keys(names: Sequence[str], normalize: Any) -> InputBands:
    """A model's input from its band names and a checked ``normalize`` (None: scaled; ``auto``: raw, pending)."""
    if normalize is None:
        return scaled_input(names)
    if normalize == AUTO:
        return InputBands(tuple(names), (), (), raw=True)
    mean, std = tuple(float(m) for m in normalize["mean"]), tuple(float(s) for s in normalize["std"])
    return InputBands(tuple(names), mean, std, raw=True)


@dataclass(frozen=True)
class BandStatistics:
    """One scene's per-band statistics of its valid pixels, from a decimated read: what ``auto`` pools."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    count: int  # valid pixels of the read

    def to_dict(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std), "count": self.count}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BandStatistics:
        return cls(tuple(data["mean"]), tuple(data["std"]), int(data["count"]))


def pooled_statistics(scenes: Sequence[BandStatistics]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std of several scenes' pixels together (each scene weighted by its valid pixels)."""
    total = sum(s.count for s in scenes)
    if not scenes or total <= 0:
        raise ValueError("no valid pixel to compute statistics from")
    bands = len(scenes[0].mean)
    mean = [sum(s.count * s.mean[b] for s in scenes) / total for b in range(bands)]
    second = [sum(s.count * (s.std[b] ** 2 + s.mean[b] ** 2) for s in scenes) / total for b in range(bands)]
    std = [math.sqrt(max(second[b] - mean[b] ** 2, 0.0)) for b in range(bands)]
    return tuple(mean), tuple(std)


def differs_wildly(scene: BandStatistics, model: InputBands, factor: float = 4.0) -> str | None:
    """How a scene's statistics differ from a raw model's beyond ``factor`` (a different sensor or bit depth): a
    band whose mean lies more than ``factor`` model stds from the model's mean, or whose std is ``factor`` times
    larger or smaller; None when they are alike."""
    if not model.raw or model.pending:
        return None
    for k, name in enumerate(model.names):
        mean, std = scene.mean[k], max(scene.std[k], 1e-12)
        if abs(mean - model.mean[k]) > factor * model.std[k] or not 1 / factor <= std / model.std[k] <= factor:
            return (
                f"band {name}: the scene's mean {mean:.4g}, std {std:.4g} against the model's mean "
                f"{model.mean[k]:.4g}, std {model.std[k]:.4g}"
            )
    return None
