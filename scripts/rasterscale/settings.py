"""The validated config as typed, frozen settings: one dataclass per section of ``config/schema.yaml``.

:func:`settings_of` builds them once from the config :func:`rasterscale.config.schema.validate_config` returns,
which has every schema default filled in: the dataclasses restate no default (the schema is the one place), a key
the schema gives no default and the config leaves unset is ``None``. Code outside ``config/`` reads attributes
(``settings.tiling.patch_size``), never ``config["tiling"]["patch_size"]`` (tests/test_settings.py keeps it so).
JSON lists become tuples; mappings the schema leaves open (a scene's ``scale``, ``normalize``, ``model.card``,
``merge.tree_tops``) stay plain values that their own modules read; a number the schema also takes as a string (a
profile's ``config:`` passes strings) is an int. :meth:`Settings.to_dict` gives the JSON form
back (jobs receive settings as JSON and rebuild them with :func:`settings_of` / :func:`section_of`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class SceneSettings:
    """A scene of ``scenes``: its raster and ground truth, and how its bands feed the model."""

    path: str
    stac: str | None
    asset: str | None
    bands: tuple[int, ...]
    normalize: Any  # "auto" or {mean, std}; None: bands scaled to 0-255
    scale: Mapping[str, Any] | None
    annotations: str | None
    image_path: str | None
    tree_tops: str | None
    rectangles_ok: bool | None
    centroids_ok: bool | None
    label_column: str | None


@dataclass(frozen=True)
class StacSettings:
    items: tuple[str, ...]
    asset: str
    bands: tuple[int, ...] | None
    normalize: Any
    scale: Mapping[str, Any] | None
    data_type: str | None


@dataclass(frozen=True)
class S3Settings:
    """Object storage on S3: applied as the environment GDAL and boto3 read (:mod:`rasterscale.raster.s3`)."""

    profile: str | None
    endpoint: str | None
    region: str | None


@dataclass(frozen=True)
class DemoScene:
    width: int
    height: int
    seed: int
    nir: bool


@dataclass(frozen=True)
class DemoSettings:
    directory: str
    crs: str
    pixel_size: float
    scenes: dict[str, DemoScene]


@dataclass(frozen=True)
class TilingSettings:
    patch_size: int
    overlap: int
    skip_nodata: bool


@dataclass(frozen=True)
class ModelSettings:
    name: str | None
    architecture: str | None
    encoder: str | None
    encoder_weights: str
    loss: str | None
    backbone: str | None
    labels: tuple[str, ...] | None
    score_threshold: float | None
    nms_threshold: float | None
    detections_per_tile: int | None
    sigma: float | None
    fpn_channels: int | None
    mask_threshold: float | None
    resize: Any
    band_names: tuple[str, ...] | None
    normalize: Any
    file: str
    card: Mapping[str, Any] | None
    backbone_weights: str


@dataclass(frozen=True)
class TrainSettings:
    scenes: tuple[str, ...]
    init: str
    validation_fraction: float
    accelerator: str
    devices: int
    nodes: int
    batch_size: int
    lr: float
    lr_reference_batch: int
    lr_scaling: str
    weight_decay: float
    epochs: int
    max_steps: int
    warmup_steps: int
    val_every_n_epochs: int
    precision: str
    workers: int
    min_visible_fraction: float
    seed: int
    log_every_n_steps: int
    checkpoint_every_n_steps: int


@dataclass(frozen=True)
class PredictSettings:
    scenes: tuple[str, ...]
    scenes_per_job: int
    accelerator: str
    devices: int
    shards: int
    probabilities: bool
    batch_size: int
    workers: int | None  # None: from the rank's cores (rasterscale.runtime.cores.rank_workers)
    precision: str
    strategy: str
    channels_last: bool
    read_cache_mb: int
    blend_mb: float
    save_every: float


@dataclass(frozen=True)
class MergeSettings:
    iou_threshold: float
    edge_tolerance: float
    containment_threshold: float
    point_distance: float
    tree_tops: Mapping[str, Any] | None


@dataclass(frozen=True)
class ProjectSettings:
    crs: str | None
    seams: bool
    iou_threshold: float
    partition_scenes: int
    summary_cell: float


@dataclass(frozen=True)
class EvaluateSettings:
    iou_threshold: float
    mask_iou_threshold: float
    score_threshold: float
    point_distance: float
    count_cell: float
    tree_top_distance: float


@dataclass(frozen=True)
class DummySettings:
    count: int
    size: int
    delay: float


@dataclass(frozen=True)
class SlurmSettings:
    """The ``slurm`` section; its numbers may come as strings from a profile's ``config:`` and are ints here."""

    launcher: str
    gres: str
    gpus_per_node: int
    partition: str
    mem_mb: int
    train_runtime: int
    train_stop_before_s: int
    predict_runtime: int

    def runtime(self, section: str) -> int:
        """The time limit (minutes) of a job of a DDP section; 0: the profile's or the partition's."""
        return self.train_runtime if section == "train" else self.predict_runtime


@dataclass(frozen=True)
class CogSettings:
    threads: int


RunSettings = TrainSettings | PredictSettings  # a DDP section: accelerator, devices, workers, precision


@dataclass(frozen=True)
class Settings:
    """The whole validated config, typed."""

    task: str
    scenes: dict[str, SceneSettings]
    stac: StacSettings
    s3: S3Settings
    scenes_on_error: str  # stop | skip
    demo: DemoSettings
    tiling: TilingSettings
    model: ModelSettings
    train: TrainSettings
    predict: PredictSettings
    merge: MergeSettings
    project: ProjectSettings
    evaluate: EvaluateSettings
    dummy: DummySettings
    slurm: SlurmSettings
    cog: CogSettings

    def ddp_section(self, name: str) -> RunSettings:
        """The DDP section by name: "train" or "predict" (a run, ``Plan.run``, is the model's name)."""
        if name == "train":
            return self.train
        if name == "predict":
            return self.predict
        raise ValueError(f"no run section '{name}' (train or predict)")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def config_without_scenes(config: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """A validated config without the scenes ``names`` (scenes_on_error: skip), in ``scenes``, ``train.scenes`` and
    ``predict.scenes``; the rest shared with ``config``."""
    sections = {
        section: {**config[section], "scenes": [name for name in config[section]["scenes"] if name not in names]}
        for section in ("train", "predict")
    }
    scenes = {name: scene for name, scene in config["scenes"].items() if name not in names}
    return {**config, **sections, "scenes": scenes}


def config_of_scenes(config: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A validated config with only the scenes ``names`` (of its own) in ``scenes`` and ``predict.scenes``, in
    that order; ``train.scenes`` and the rest shared with ``config`` (a batch's plan)."""
    scenes = {name: config["scenes"][name] for name in names if name in config["scenes"]}
    listed = set(config["predict"]["scenes"])
    predict = {**config["predict"], "scenes": [name for name in scenes if name in listed]}
    return {**config, "predict": predict, "scenes": scenes}


def settings_of(config: Mapping[str, Any]) -> Settings:
    """The typed settings of a validated config (or of :meth:`Settings.to_dict`'s JSON)."""
    return section_of(Settings, config, "config")


class AbsentSection:
    """A section a job's file does not carry (a job reruns when what it uses changes, so it is given only that):
    reading it is an error naming the section, never a silent default."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self._absent(attr)

    def _absent(self, key: object) -> LookupError:
        return LookupError(f"settings.{self._name}.{key}: this job's file does not carry the {self._name} section")

    # a mapping section (scenes): its items are not there either
    def __getitem__(self, key: object) -> Any:
        raise self._absent(key)

    def __contains__(self, key: object) -> bool:
        raise self._absent(key)

    def __iter__(self) -> Any:
        raise self._absent("*")

    def __repr__(self) -> str:
        return f"AbsentSection({self._name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AbsentSection) and other._name == self._name

    def __hash__(self) -> int:
        return hash(("AbsentSection", self._name))


def job_settings(sections: Mapping[str, Any]) -> Settings:
    """The settings of a job from the sections its file carries (:meth:`Settings.to_dict`'s form, some sections
    only): the sections it lacks are :class:`AbsentSection` (read one: a LookupError naming it)."""
    hints = _field_types(Settings)
    unknown = sorted(set(sections) - hints.keys())
    if unknown:
        raise ValueError(f"{unknown[0]}: not a config section")
    built: dict[str, Any] = {
        name: _value(hint, sections[name], name) if name in sections else AbsentSection(name)
        for name, hint in hints.items()
    }
    return Settings(**built)


def sections_only(settings: Settings, *names: str, **sections: Any) -> Settings:
    """``settings`` with only the sections ``names`` (as they are) and ``sections`` (given, typed: a section as
    a job gets it), the others :class:`AbsentSection`: a job's settings, built from the plan's without a trip
    through JSON."""
    kept = {name: getattr(settings, name) for name in names} | sections
    built: dict[str, Any] = {f.name: kept.get(f.name, AbsentSection(f.name)) for f in dataclasses.fields(Settings)}
    return Settings(**built)


def carried(settings: Settings) -> dict[str, Any]:
    """The sections a job's settings carry, as JSON values (:func:`job_settings`'s input)."""
    return {
        field.name: to_dict(getattr(settings, field.name))
        for field in dataclasses.fields(settings)
        if not isinstance(getattr(settings, field.name), AbsentSection)
    }


def section_of(cls: type[T], values: Mapping[str, Any], key: str) -> T:
    """A settings dataclass from its section's validated values; a key the dataclass lacks is a schema change the
    settings missed (a ValueError naming it: every config key takes effect or is rejected)."""
    hints = _field_types(cls)
    unknown = sorted(set(values) - hints.keys())
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: a config key the typed settings ({cls.__name__}) do not know")
    built = {name: _value(hint, values.get(name), f"{key}.{name}") for name, hint in hints.items()}
    return cls(**built)


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    """A settings class's fields and their resolved types, once per class (resolving them per scene cost 0.15 ms
    each: 1.5 s for 10,000 scenes)."""
    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls)
        _FIELD_TYPES[cls] = {field.name: hints[field.name] for field in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


def _value(hint: Any, value: Any, key: str) -> Any:
    """``value`` as the field's type: a nested section, a mapping of sections, a tuple of a JSON list."""
    if value is None:
        return None
    for kind in _members(hint):
        if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
            return section_of(kind, value, key)  # type: ignore[arg-type]
        origin = typing.get_origin(kind)
        if origin is dict and isinstance(value, Mapping):
            item = typing.get_args(kind)[1]
            return {name: _value(item, entry, f"{key}.{name}") for name, entry in value.items()}
        if origin is tuple and isinstance(value, list | tuple):
            return tuple(value)
        if kind is int and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{key}: {value!r} is not a whole number") from None
    return value


def _members(hint: Any) -> tuple[Any, ...]:
    """The types of a union (``X | None``), or the type itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def to_dict(value: Any) -> Any:
    """Settings as plain JSON values: a section's dict, a mapping of sections' dicts, lists for tuples, a plain
    value as it is (what job files, the stored plan and the report show)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: to_dict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_dict(item) for item in value]
    return value
