"""The ``scenes`` key in its three forms: a mapping, a glob of rasters, a scene table (CSV); names made from file
stems, and where each scene came from, for errors that name the table's line (or the STAC item:
:mod:`rasterscale.config.stac`)."""

from __future__ import annotations

import csv
import glob
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rasterscale.errors import ConfigError

SCENE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


RASTER_SUFFIXES = (".tif", ".tiff", ".vrt", ".jp2", ".img")  # a scenes string naming one raster is a glob of it
STAC_ORIGIN = "STAC item"  # how the origin of a scene whose path a STAC item gave begins


def scene_properties(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of one scene's keys (the allowed columns of a scene table)."""
    return schema["properties"]["scenes"]["additionalProperties"]["properties"]


def is_glob(value: str) -> bool:
    return any(char in value for char in "*?[") or value.lower().endswith(RASTER_SUFFIXES)


def sanitized_scene_name(stem: str) -> str:
    """A file stem as a scene name: characters outside [A-Za-z0-9_-] become '_', leading '_'/'-' go."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem).lstrip("_-")


def scenes_from_glob(pattern: str) -> tuple[dict[str, Any], dict[str, str]]:
    """One scene per raster the pattern matches (sorted), named by its file stem (no origins: the path is the
    file's own)."""
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise ConfigError(f"config: key 'scenes': the glob '{pattern}' matches no file")
    scenes: dict[str, Any] = {}
    for path in paths:
        name = sanitized_scene_name(Path(path).stem)
        if not name:
            raise ConfigError(f"config: key 'scenes': {path} (glob '{pattern}') gives no usable scene name; rename it")
        if name in scenes:
            raise ConfigError(
                f"config: key 'scenes': the glob '{pattern}' gives the scene name '{name}' to both "
                f"{scenes[name]['path']} and {path}; rename one, or list the scenes in a table"
            )
        scenes[name] = {"path": path}
    return scenes, {}


def table_cell(value: str, schema: Mapping[str, Any]) -> Any:
    """A table cell as the key's type: strings as written, anything else (lists, numbers, mappings) as YAML."""
    return value if schema.get("type") == "string" else yaml.safe_load(value)


def scenes_from_table(path: str, properties: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Scenes of a tab-separated table: a header row (name, path, annotations, ...), then one scene a line."""
    if not Path(path).is_file():
        raise ConfigError(
            f"config: key 'scenes': scene table {path} not found (scenes: a mapping, a tab-separated table "
            "with columns name, path, annotations, ..., or a glob of rasters)"
        )
    with open(path, newline="") as handle:
        lines = [(n, row) for n, row in enumerate(csv.reader(handle, delimiter="\t"), start=1) if any(row)]
    lines = [(n, [cell.strip() for cell in row]) for n, row in lines if not row[0].lstrip().startswith("#")]
    if not lines:
        raise ConfigError(f"{path}: empty scene table (a header row, then one scene a line)")
    header_line, header = lines[0]
    allowed = ["name", *properties]
    unknown = [column for column in header if column not in allowed]
    if unknown:
        raise ConfigError(f"{path} line {header_line}: unknown column '{unknown[0]}' (allowed: {', '.join(allowed)})")
    if "name" not in header:
        raise ConfigError(f"{path} line {header_line}: missing column 'name' (columns: {', '.join(header)})")
    if "path" not in header and "stac" not in header:
        raise ConfigError(
            f"{path} line {header_line}: missing column 'path' (or 'stac', a STAC item per scene; columns: "
            f"{', '.join(header)})"
        )
    if len(set(header)) != len(header):
        raise ConfigError(f"{path} line {header_line}: a column is named twice ({', '.join(header)})")
    scenes: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for number, row in lines[1:]:
        where = f"{path} line {number}"
        if len(row) != len(header):
            raise ConfigError(f"{where}: {len(row)} cells, but the header has {len(header)} columns")
        cells = dict(zip(header, row, strict=True))
        name = cells.pop("name")
        if not SCENE_NAME.match(name):
            raise ConfigError(f"{where}, column 'name': '{name}' is not a scene name ([A-Za-z0-9][A-Za-z0-9_-]*)")
        if name in scenes:
            raise ConfigError(f"{where}, column 'name': scene '{name}' is already on {origins[name]}")
        try:
            scenes[name] = {key: table_cell(value, properties[key]) for key, value in cells.items() if value}
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}: a cell is not valid YAML ({str(err).splitlines()[0]})") from err
        origins[name] = where
    return scenes, origins


def expand_scenes(value: Any, schema: Mapping[str, Any]) -> tuple[Any, dict[str, str]]:
    """``scenes`` in the mapping form, and where each scene came from (empty for a mapping)."""
    if not isinstance(value, str):
        return value, {}
    if is_glob(value):
        return scenes_from_glob(value)
    return scenes_from_table(value, scene_properties(schema))


def expand_all(config: dict[str, Any]) -> None:
    """``train.scenes``/``predict.scenes`` ``all`` as lists, in the scenes' order."""
    scenes = config["scenes"]
    if config["predict"]["scenes"] == "all":
        config["predict"]["scenes"] = list(scenes)
    if config["train"]["scenes"] == "all":
        config["train"]["scenes"] = [name for name, scene in scenes.items() if scene.get("annotations")]


def scene_key(name: str, key: str, origins: Mapping[str, str]) -> str:
    """Where a scene's key is set: ``scenes.a.path``, or the table's file, line and column; a path from a STAC item
    names the item."""
    if name not in origins:
        return f"scenes.{name}.{key}"
    return origins[name] if origins[name].startswith(STAC_ORIGIN) else f"{origins[name]}, column '{key}'"
