"""A model's input bands (:class:`~rasterscale.raster.bands.InputBands`) as a config asks for them, torch-free: what
the plan checks at dry run and every task's model configuration records.

- Predicting with a model file: the file's bands and statistics; ``model.band_names`` and ``model.normalize``
  may only repeat them.
- Training (from scratch or from ``train.init``): the training scenes' band count (``scenes.X.bands``, the same
  for every training scene), ``model.band_names`` (else :func:`~rasterscale.raster.bands.default_band_names`),
  and ``model.normalize``, else the training scenes' ``normalize`` (the same for each), else scaled bands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rasterscale.errors import ConfigError
from rasterscale.raster.bands import InputBands, check_normalize, default_band_names, input_of_keys
from rasterscale.settings import SceneSettings, Settings

DEFAULT_COUNT = 3


def scene_band_count(scene: SceneSettings) -> int:
    return len(scene.bands or range(DEFAULT_COUNT))


def _agreed(settings: Settings, names: Sequence[str], what: str, value: Callable[[SceneSettings], Any]) -> Any:
    """One value of the scenes ``names`` (``value(scene)``), which must agree: one line naming two that differ."""
    scenes = settings.scenes
    found: dict[str, Any] = {}
    for name in names:
        if name in scenes:
            found[name] = value(scenes[name])
    distinct = {repr(v): k for k, v in found.items()}
    if len(distinct) > 1:
        (a, b) = list(distinct.values())[:2]
        raise ConfigError(
            f"config: training scenes {a} and {b} differ in {what} ({found[a]} against {found[b]}): one model "
            "takes one kind of input"
        )
    return next(iter(found.values()), None)


def configured_input(settings: Settings) -> InputBands:
    """The input the config's keys ask a model to be trained for (see the module docstring)."""
    model = settings.model
    names = list(settings.train.scenes)
    count = _agreed(settings, names, "their number of bands (bands)", scene_band_count) or DEFAULT_COUNT
    band_names = model.band_names
    if band_names is not None and len(band_names) != count:
        raise ConfigError(
            f"config: key 'model.band_names' names {len(band_names)} band(s) but the training scenes' bands give "
            f"{count}"
        )
    normalize = model.normalize
    if normalize is None:
        normalize = _agreed(settings, names, "normalize", lambda scene: scene.normalize)
        check_normalize(normalize, count, f"scenes.{names[0] if names else 'X'}.normalize")
    else:
        check_normalize(normalize, count, "model.normalize")
    try:
        return input_of_keys(tuple(band_names or default_band_names(count)), normalize)
    except ValueError as err:
        raise ConfigError(f"config: key 'model.band_names': {err}") from None


def model_input(settings: Settings, recorded: InputBands | None, predicting: bool) -> InputBands:
    """The effective input of a config's model: a model file's (``recorded``) when ``predicting`` with it, else
    :func:`configured_input`. A key that contradicts the file: one line naming both."""
    if recorded is None or not predicting:
        return configured_input(settings)
    model = settings.model
    names = model.band_names
    if names is not None and [n.casefold() for n in names] != [n.casefold() for n in recorded.names]:
        raise ConfigError(
            f"config: key 'model.band_names' is [{', '.join(names)}] but the model file takes "
            f"[{', '.join(recorded.names)}]: leave it out to use the file's"
        )
    if model.normalize is not None:
        raise ConfigError(
            "config: key 'model.normalize' is set but the model file records its own normalization "
            f"({recorded.describe()}): leave it out"
        )
    return recorded
