"""The typed settings (rasterscale.settings): one dataclass per schema section, with the schema's keys and no
default of its own, and code outside config/ that reads them by attribute, never as ``config["…"]``."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rasterscale import settings as settings_module
from rasterscale.config.schema import load_config
from rasterscale.settings import SceneSettings, Settings, section_of, settings_of

REPO = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())


def schema_sections() -> Iterator[tuple[str, dict, type]]:
    """(key, schema object, settings class) of every object the settings type: the top level, each section, a
    scene entry, a demo scene."""
    hints = typing.get_type_hints(Settings)
    yield "config", SCHEMA, Settings
    for name, prop in SCHEMA["properties"].items():
        if dataclasses.is_dataclass(hints[name]):
            yield name, prop, hints[name]
    yield "scenes.X", SCHEMA["properties"]["scenes"]["additionalProperties"], SceneSettings
    demo = SCHEMA["properties"]["demo"]["properties"]["scenes"]["additionalProperties"]
    yield "demo.scenes.X", demo, settings_module.DemoScene


@pytest.mark.parametrize(("key", "schema", "cls"), list(schema_sections()), ids=lambda v: getattr(v, "__name__", v))
def test_each_settings_class_has_exactly_its_schema_sections_keys_and_no_default(key, schema, cls):
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields] == list(schema["properties"]), key
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)


@pytest.mark.parametrize("name", ["config.yaml", "segmentation.yaml", "instances.yaml", "height.yaml"])
def test_the_demo_configs_round_trip_through_their_settings(name):
    config = load_config(REPO / "config" / name)
    settings = settings_of(config)
    assert settings.tiling.patch_size == config["tiling"]["patch_size"]
    assert settings.train.scenes == tuple(config["train"]["scenes"])
    assert settings_of(settings.to_dict()) == settings  # the JSON form jobs receive


def test_a_key_the_settings_do_not_know_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"tiling\.stride: a config key the typed settings"):
        section_of(
            settings_module.TilingSettings,
            {"patch_size": 400, "overlap": 80, "skip_nodata": True, "stride": 2},
            "tiling",
        )


# -- no config["…"] outside config/ --------------------------------------------------------------------------------

TOP = set(SCHEMA["properties"])
KEYS = TOP | {key for schema in (s for _, s, _ in schema_sections()) for key in schema.get("properties", {})}
CONFIG_NAMES = re.compile(r"config|cfg", re.IGNORECASE)


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def reads_config(node: ast.expr) -> bool:
    """Whether an expression is the config or one of its sections: a name with "config"/"cfg" in it or a section's
    name (``config``, ``train_cfg``, ``tiling``), or a section of one (``config["tiling"]``)."""
    if isinstance(node, ast.Subscript):
        key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        return key in TOP and reads_config(node.value)
    name = _name(node)
    return name is not None and (bool(CONFIG_NAMES.search(name)) or name in TOP)


def _is_config(node: ast.expr) -> bool:
    name = _name(node)
    return name is not None and bool(CONFIG_NAMES.search(name))


def keyed_read(node: ast.AST) -> tuple[ast.expr, object] | None:
    """``(X, "key")`` of ``X["key"]`` or ``X.get("key")`` (a constant key); None for any other node."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.value, node.slice.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        return node.func.value, node.args[0].value
    return None


def config_reads(source: str) -> list[str]:
    """Every ``X["key"]`` or ``X.get("key")`` of a config key on the config or a section of it, and every section
    taken by a variable (``config[section]``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        read = keyed_read(node)
        if read is not None and reads_config(read[0]) and read[1] in KEYS:
            found.append(f"line {node.lineno}: [{read[1]!r}]")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) and _is_config(node.value):
            found.append(f"line {node.lineno}: [{node.slice.id}]")
    return sorted(found)


def test_the_read_finder_finds_the_forms_of_a_config_read():
    source = """
a = config["tiling"]["patch_size"]
b = train_cfg["lr"]
c = cfg.get("file")
d = row["name"]
e = config[section]
f = settings.scenes[name]
"""
    found = ["line 2: ['patch_size']", "line 2: ['tiling']", "line 3: ['lr']", "line 4: ['file']", "line 6: [section]"]
    assert config_reads(source) == found


def test_no_code_below_config_reads_the_config_as_a_mapping():
    """Code outside config/ (and the settings built from it) reads typed settings; the rules and entry scripts too
    (Snakemake files by pattern)."""
    counts: dict[str, list[str]] = {}
    for path in sorted((REPO / "scripts").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("scripts/rasterscale/config/") or relative == "scripts/rasterscale/settings.py":
            continue  # the config's own modules, and the settings built from it
        reads = config_reads(path.read_text())
        if reads:
            counts[relative] = reads
    for path in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]:
        reads = re.findall(r"CONFIG\[|config\[\"|DEMO\[", path.read_text())
        if reads:
            counts[path.relative_to(REPO).as_posix()] = reads
    assert not counts, f"config read as a mapping (read the typed settings instead): {counts}"


# -- the task boundary is typed: a task reads a Scene, a ProjectJob and its sources by attribute -------------------

JOB_MEMBERS = re.compile(r"^(scene|job|source|area|partition)s?$")


def job_mapping_reads(source: str) -> list[str]:
    """Every ``scene["key"]``, ``job.get("key")``, ``source["key"]`` ...: a job's member read as a mapping."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target, key = keyed_read(node) or (None, None)
        if isinstance(target, ast.Name) and JOB_MEMBERS.match(target.id) and isinstance(key, str):
            found.append(f"line {node.lineno}: {target.id}[{key!r}]")
    return found


def test_the_job_mapping_finder_finds_a_member_read_by_key():
    source = """
a = scene["raster"]
b = job.get("owners")
c = source["name"]
d = scene.outputs["classes"]
e = job.settings.project.iou_threshold
"""
    assert job_mapping_reads(source) == ["line 2: scene['raster']", "line 3: job['owners']", "line 4: source['name']"]


def test_the_tasks_read_their_scenes_and_project_jobs_by_attribute_not_as_mappings():
    """A task's merge, evaluation, quicklook and counts take a Scene; its project merge a ProjectJob (as its
    ProjectJobFields) with ProjectSource sources: typed fields, a layer's file by key in ``outputs`` only."""
    counts = {}
    for path in [*sorted((REPO / "scripts/rasterscale/tasks").rglob("*.py")), REPO / "scripts/merge.py"]:
        reads = job_mapping_reads(path.read_text())
        if reads:
            counts[path.relative_to(REPO).as_posix()] = reads
    assert not counts, f"a job's member read as a mapping (read its typed fields): {counts}"
