"""Load and validate the workflow configuration against ``config/schema.yaml``.

Validation fills in the schema's defaults and turns the first problem into one line that names the key,
so that a typo fails ``snakemake -n`` instead of a GPU job an hour later.

``scenes`` may be a mapping, a scene table (tab-separated, a header row naming the columns ``name``, ``path``
and any other per-scene key of the schema: the snakemake-workflows sample-sheet convention) or a glob of rasters
(scene names from the file stems). Tables and globs are expanded into the mapping form before validation, so
that their scenes are checked like any other, with errors naming the table's file and line. ``train.scenes`` and
``predict.scenes`` may be ``all``: every scene (for training: every scene with annotations). A scene's raster
may be a STAC item's asset (``scenes.X.stac``), and the ``stac`` section adds a scene per item of its Items and
ItemCollections (:mod:`rasterscale.config.stac`): they are read with the tables and globs, before validation.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from rasterscale.config.objects import fetch_whole_files, refuse_credentials_in_urls
from rasterscale.config.scenes import expand_all, expand_scenes, sanitized_scene_name
from rasterscale.config.stac import add_section_scenes, resolve_scene_items
from rasterscale.errors import ConfigError
from rasterscale.raster.item_header import ItemHeader
from rasterscale.raster.s3 import configure_s3
from rasterscale.tasks.registry import TASKS

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "config" / "schema.yaml"


def load_schema(path: Path = SCHEMA_PATH) -> dict[str, Any]:
    """config/schema.yaml, with what the tasks say (:mod:`rasterscale.tasks.registry`): the values of ``task``,
    and of each task's own keys (``TaskSpec.schema_enums``; null stays allowed where the file allows it)."""
    with open(path) as handle:
        schema = yaml.safe_load(handle)
    schema["properties"]["task"]["enum"] = list(TASKS)
    for spec in TASKS.values():
        for dotted, values in spec.schema_enums.items():
            section, key = dotted.split(".")
            prop = schema["properties"][section]["properties"][key]
            given = prop.get("enum", [])  # the file's, and the values of the tasks before this one
            earlier = [value for value in given if value is not None]
            prop["enum"] = [*([None] if None in given else []), *dict.fromkeys([*earlier, *values])]
    return schema


def _extend_with_defaults(validator_class: type[Any]) -> type[Any]:
    """A validator that fills in ``default`` values of absent properties while it validates."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator: Any, properties: dict, instance: Any, schema: dict) -> Iterator:
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultingValidator = _extend_with_defaults(jsonschema.Draft202012Validator)


def _key_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path) or "<top level>"


def describe_error(error: jsonschema.ValidationError) -> str:
    """One line naming the key and the problem."""
    where = _key_path(error)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        prefix = f"{where}." if error.absolute_path else ""
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"unknown key '{prefix}{unknown[0]}'{hint}"
    if error.validator == "required":
        return f"{where}: {error.message}"
    return f"key '{where}': {error.message}"


RENAMED = {  # old key -> new key (read, with a notice)
    ("predict", "nodes"): ("predict", "shards"),
    ("model", "checkpoint"): ("model", "file"),
    ("predict", "checkpoint_every"): ("predict", "save_every"),
}


def rename_deprecated(instance: dict[str, Any], notices: list[str]) -> None:
    """Move renamed keys to their new names, with a notice each; both set is an error."""
    for (section, old), (_, new) in RENAMED.items():
        values = instance.get(section)
        if isinstance(values, dict) and old in values:
            if new in values:
                raise ConfigError(f"config: key '{section}.{old}' is the old name of '{section}.{new}': set only {new}")
            values[new] = values.pop(old)
            notices.append(f"config: key '{section}.{old}' is deprecated: it is now '{section}.{new}' (same meaning)")


def check_task_keys(raw: Mapping[str, Any], default_task: str) -> None:
    """A key set that only other tasks read fails with one line (it would otherwise be silently ignored)."""
    task = raw.get("task", default_task)
    own = (
        {(section, key) for section, keys in TASKS[task].config_keys.items() for key in keys}
        if task in TASKS
        else set()
    )
    readers: dict[tuple[str, str], list[str]] = {}
    for name, spec in TASKS.items():
        for section, keys in spec.config_keys.items():
            for key in keys:
                readers.setdefault((section, key), []).append(name)
    for (section, key), tasks in readers.items():
        values = raw.get(section)
        if (section, key) not in own and isinstance(values, dict) and values.get(key) is not None:
            which = " and ".join([", ".join(tasks[:-1]), tasks[-1]] if len(tasks) > 1 else tasks)
            raise ConfigError(f"config: key '{section}.{key}' applies to task {which} only, and task is {task}")
    own_scene_keys = set(TASKS[task].scene_keys) if task in TASKS else set()
    scenes = raw.get("scenes")
    for name, spec in TASKS.items():
        for key in set(spec.scene_keys) - own_scene_keys:
            for scene, values in scenes.items() if isinstance(scenes, dict) else ():
                if isinstance(values, dict) and values.get(key) is not None:
                    raise ConfigError(
                        f"config: key 'scenes.{scene}.{key}' applies to task {name} only, and task is {task}"
                    )


def validate_part(value: Any, schema: dict[str, Any], key: str) -> None:
    """Validate one section before the whole config is (its defaults filled in): the first problem as one line
    naming its key."""
    errors = sorted(_DefaultingValidator(schema).iter_errors(value), key=lambda e: (len(e.path), str(e.path)))
    if errors:
        errors[0].path.appendleft(key)
        raise ConfigError(f"config: {describe_error(errors[0])}")


def expand_stac(
    instance: dict[str, Any],
    schema: dict[str, Any],
    origins: dict[str, str],
    headers: dict[str, ItemHeader] | None = None,
) -> tuple[Any, dict[str, str]]:
    """The scenes with the STAC items' read: each scene's ``stac`` item gives its ``path``, and the ``stac``
    section's items add a scene each; where each scene came from (``headers``: the items' trusted headers)."""
    scenes = instance["scenes"]
    if not isinstance(scenes, dict):
        return scenes, origins  # the schema says what is wrong
    origins = dict(origins)
    resolve_scene_items(scenes, origins, headers)
    if "stac" not in instance:
        return scenes, origins
    validate_part(instance["stac"], schema["properties"]["stac"], "stac")
    return add_section_scenes(scenes, origins, instance["stac"], headers)


def validate_config(
    config: Mapping[str, Any],
    schema: dict[str, Any] | None = None,
    origins: dict[str, str] | None = None,
    notices: list[str] | None = None,
    default_bands: set[str] | None = None,
    item_headers: dict[str, ItemHeader] | None = None,
) -> dict[str, Any]:
    """Return a validated copy of ``config`` with defaults filled in; raise ConfigError on the first problem.

    ``origins``, when given, is filled with where each scene of a table or glob came from (see
    :func:`scene_key`); ``notices`` with warnings: renamed keys, scenes scored on their own training data;
    ``default_bands`` with the scenes whose ``bands`` are the default (not the user's choice); ``item_headers``
    with the header each scene's STAC item gives (:mod:`rasterscale.raster.item_header`), where it gives one."""
    instance = copy.deepcopy(dict(config))
    rename_deprecated(instance, notices if notices is not None else [])
    schema = schema or load_schema()
    if "s3" in instance:
        validate_part(instance["s3"], schema["properties"]["s3"], "s3")
    configure_s3(instance.get("s3") or {})  # before any s3:// file is read: the STAC items below, the headers after
    instance["scenes"], found = expand_scenes(instance.get("scenes", {}), schema)
    instance["scenes"], found = expand_stac(instance, schema, found, item_headers)
    if origins is not None:
        origins.update(found)
    if default_bands is not None and isinstance(instance["scenes"], dict):  # which scenes' bands the user left out
        default_bands.update(
            n for n, scene in instance["scenes"].items() if isinstance(scene, dict) and "bands" not in scene
        )
    validator = _DefaultingValidator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        path = list(errors[0].absolute_path)
        where = f"{found[path[1]]}: " if path[:1] == ["scenes"] and len(path) > 1 and path[1] in found else ""
        raise ConfigError(f"config: {where}{describe_error(errors[0])}")
    check_task_keys(config, schema["properties"]["task"]["default"])
    if instance["model"]["name"] is None:
        instance["model"]["name"] = default_model_name(instance["task"], instance["model"]["file"])
    expand_all(instance)
    check_consistency(instance)
    refuse_credentials_in_urls(instance)
    fetch_whole_files(instance)
    if notices is not None:
        notices.extend(scored_on_training_data(instance))
    return instance


def default_model_name(task: str, file: str) -> str:
    """model.name when unset: a given model file's name (its stem, as a scene name: the run's outputs are keyed by
    it, so two model files predicting the same scenes keep both), else (or when nothing of the stem is left) the
    task's default."""
    return (sanitized_scene_name(Path(file).stem) if file else "") or TASKS[task].default_model_name


def check_consistency(config: Mapping[str, Any]) -> None:
    """Checks that span several keys (the schema cannot express them)."""
    scenes = config["scenes"]
    tiling = config["tiling"]
    if tiling["overlap"] >= tiling["patch_size"]:
        raise ConfigError(
            f"config: key 'tiling.overlap' ({tiling['overlap']}) must be smaller than "
            f"tiling.patch_size ({tiling['patch_size']})"
        )
    for section in ("train", "predict"):
        for name in config[section]["scenes"]:
            if name not in scenes:
                raise ConfigError(
                    f"config: key '{section}.scenes' names scene '{name}', which is not under 'scenes' "
                    f"(known: {', '.join(sorted(scenes))})"
                )
    for key, values in (("train.scenes", config["train"]["scenes"]), ("predict.scenes", config["predict"]["scenes"])):
        twice = sorted(name for name, count in Counter(values).items() if count > 1)
        if twice:
            raise ConfigError(f"config: key '{key}' names scene '{twice[0]}' twice: list each scene once")
    labels = config["model"]["labels"] or []
    folded = Counter(name.casefold() for name in labels)
    twice = sorted({name for name in labels if folded[name.casefold()] > 1})
    if twice:
        raise ConfigError(f"config: key 'model.labels' names class '{twice[0]}' twice ({', '.join(labels)})")
    if config["train"]["max_steps"] == 0 or config["train"]["max_steps"] < -1:
        raise ConfigError(
            f"config: key 'train.max_steps' is {config['train']['max_steps']}: -1 (no limit, train.epochs decide) or "
            "at least 1"
        )
    for name in config["train"]["scenes"]:
        if not scenes[name].get("annotations"):
            raise ConfigError(f"config: training scene '{name}' has no 'annotations' (scenes.{name}.annotations)")
    if config["train"]["scenes"] and config["model"]["file"]:
        raise ConfigError(
            "config: model.file and train.scenes are both set, and model.file is predicted with, not trained: "
            "leave train.scenes empty to predict with it, or give it as train.init to fine-tune it"
        )
    if config["predict"]["scenes"] and not config["train"]["scenes"] and not config["model"]["file"]:
        raise ConfigError(
            "config: predict.scenes is set but there is nothing to predict with: set train.scenes or model.file"
        )


def nothing_to_do(config: Mapping[str, Any]) -> str | None:
    """Why the default target of a validated config would do nothing (no scene to train on or predict), or None."""
    if config["train"]["scenes"] or config["predict"]["scenes"]:
        return None
    known = f"scenes: {', '.join(config['scenes'])}" if config["scenes"] else "no scenes"
    return (
        f"config: train.scenes and predict.scenes are both empty ({known}): nothing to do; name the scenes to train "
        "on or predict"
    )


def scored_on_training_data(config: Mapping[str, Any]) -> list[str]:
    """Warnings for scenes both trained on and evaluated (scores of training data, not of unseen data); the scene's
    evaluation is the run's (rasterscale.jobs.paths.RunPaths, a layer above: the run is model.name)."""
    trained = set(config["train"]["scenes"]) if not config["model"]["file"] else set()
    return [
        f"scene {name} is trained on (train.scenes) and predicted and scored (predict.scenes): "
        f"results/{config['model']['name']}/{name}/evaluation.json scores the model on its own training data"
        for name in config["predict"]["scenes"]
        if name in trained and config["scenes"][name].get("annotations")
    ]


def load_config(path: str | Path) -> dict[str, Any]:
    with open(path) as handle:
        raw = yaml.safe_load(handle) or {}
    return validate_config(raw)
