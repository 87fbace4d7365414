"""Load and validate the workflow configuration against ``config/schema.yaml``.

Validation fills in the schema's defaults and turns the first problem into one line that names the key,
so that a typo fails ``snakemake -n`` instead of a GPU job an hour later.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


class ConfigError(ValueError):
    """A configuration problem, worded as one line that names the key."""


def load_schema(path: Path = SCHEMA_PATH) -> dict[str, Any]:
    with open(path) as handle:
        return yaml.safe_load(handle)


def _extend_with_defaults(validator_class: type) -> type:
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


def validate_config(config: Mapping[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a validated copy of ``config`` with defaults filled in; raise ConfigError on the first problem."""
    instance = copy.deepcopy(dict(config))
    validator = _DefaultingValidator(schema or load_schema())
    errors = sorted(validator.iter_errors(instance), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        raise ConfigError(f"config: {describe_error(errors[0])}")
    check_consistency(instance)
    return instance


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
    for name in config["train"]["scenes"]:
        if not scenes[name].get("annotations"):
            raise ConfigError(f"config: training scene '{name}' has no 'annotations' (scenes.{name}.annotations)")
    if config["predict"]["scenes"] and not config["train"]["scenes"] and not config["model"]["checkpoint"]:
        raise ConfigError(
            "config: predict.scenes is set but there is nothing to predict with: set train.scenes or model.checkpoint"
        )


def load_config(path: str | Path) -> dict[str, Any]:
    with open(path) as handle:
        raw = yaml.safe_load(handle) or {}
    return validate_config(raw)
