"""The configuration reference (docs/configuration.md), rendered as Markdown from ``config/schema.yaml``.

The schema is the one place where keys, types, defaults and descriptions live; this module only renders it: one
section per top-level key (its description, type and default), then a table of every key below it by dotted path.
Keys of a mapping with free names (``scenes``, ``demo.scenes``) appear as ``{name}`` in the path, keys of an
object alternative (``model.resize: {min_size, max_size}``) under the key itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

HEADER = (
    "# Configuration reference\n\n"
    "<!-- Generated from config/schema.yaml by `make docs` (scripts/config_reference.py): edit the schema, "
    "not this file. -->\n\n"
    "Every key of a rasterscale config: its type, its default (filled in when the key is left out) and what it "
    "does. Generated from `config/schema.yaml`, which validates every config when the workflow loads."
)
FREE_NAME = "{name}"
NO_DEFAULT = "—"
_CODE_SPAN = re.compile(r"(`[^`]*`)")


@dataclass(frozen=True)
class KeyDoc:
    """One key of the schema: its dotted path and the schema node that describes it."""

    path: str
    node: Mapping[str, Any]
    required: bool = False


def escape_text(text: str) -> str:
    """Prose for a Markdown table cell: one line, ``|`` escaped; outside code spans ``<`` and ``*`` too."""
    parts = _CODE_SPAN.split(" ".join(text.split()))
    escaped = [part if part.startswith("`") else part.replace("<", "&lt;").replace("*", r"\*") for part in parts]
    return "".join(escaped).replace("|", r"\|")


def code(text: str) -> str:
    """A Markdown code span (``|`` escaped for table cells)."""
    return "`" + text.replace("|", r"\|") + "`"


def format_value(value: Any) -> str:
    """A value as it is written in a YAML config: null, true, "" for an empty string, flow style for collections."""
    if isinstance(value, str):
        return value if value else '""'
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...")


def format_constraints(node: Mapping[str, Any]) -> str:
    """Bounds, sizes and patterns of a node, e.g. ``≥ 1``, ``0–1``, ``3 items``."""
    parts = []
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None and high is not None:
        parts.append(f"{format_value(low)}–{format_value(high)}")
    elif low is not None:
        parts.append(f"≥ {format_value(low)}")
    elif high is not None:
        parts.append(f"≤ {format_value(high)}")
    if "exclusiveMinimum" in node:
        parts.append(f"> {format_value(node['exclusiveMinimum'])}")
    fewest, most = node.get("minItems"), node.get("maxItems")
    if fewest is not None and fewest == most:
        parts.append(f"{fewest} items")
    elif fewest is not None and most is not None:
        parts.append(f"{fewest}–{most} items")
    elif fewest is not None or most is not None:
        parts.append(f"≥ {fewest} items" if fewest is not None else f"≤ {most} items")
    if "pattern" in node:
        parts.append("matching " + code(node["pattern"]))
    if "pattern" in node.get("propertyNames", {}):
        parts.append("names matching " + code(node["propertyNames"]["pattern"]))
    return ", ".join(parts)


def format_type(node: Mapping[str, Any]) -> str:
    """The type of a node: its enum or const, its JSON types (arrays with their items), alternatives joined by or,
    then its constraints, e.g. ``integer, ≥ 1`` or ``array of (integer, ≥ 1), 3 items``."""
    if "enum" in node:
        return "one of " + ", ".join(code(format_value(value)) for value in node["enum"])
    if "const" in node:
        return code(format_value(node["const"]))
    alternatives = [alt for alt in node.get("oneOf", []) + node.get("anyOf", []) if set(alt) != {"required"}]
    names = node.get("type", "object" if "properties" in node else "")
    names = [names] if isinstance(names, str) else list(names)
    words = [_type_word(name, node) for name in names if name]
    words += [format_type(alt) for alt in alternatives]
    text = " or ".join(word for word in words if word)
    constraints = format_constraints(node)
    return ", ".join(part for part in (text, constraints) if part)


def _type_word(name: str, node: Mapping[str, Any]) -> str:
    """One JSON type name; an array names its items' type, an object the alternative sets of keys it requires."""
    if name == "array" and "items" in node:
        items = format_type(node["items"])
        return "array of " + (f"({items})" if "," in items else items)
    variants = [alt["required"] for alt in node.get("oneOf", []) if set(alt) == {"required"}]
    if name == "object" and variants:
        return "object with " + " or ".join("{" + ", ".join(keys) + "}" for keys in variants)
    return name


def format_default(key: KeyDoc) -> str:
    """The default of a key as a code span, ``required`` for a required key, else a dash."""
    if "default" in key.node:
        return code(format_value(key.node["default"]))
    return "required" if key.required else NO_DEFAULT


def child_keys(path: str, node: Mapping[str, Any]) -> Iterator[KeyDoc]:
    """The keys directly below a node: its properties, those of a free-named mapping and of object alternatives."""
    required = set(node.get("required", []))
    for name, child in node.get("properties", {}).items():
        yield KeyDoc(f"{path}.{name}", child, name in required)
    free = node.get("additionalProperties")
    if isinstance(free, Mapping):
        yield KeyDoc(f"{path}.{FREE_NAME}", free)
    for alternative in node.get("oneOf", []) + node.get("anyOf", []):
        if "properties" in alternative:
            yield from child_keys(path, alternative)


def walk_keys(path: str, node: Mapping[str, Any]) -> Iterator[KeyDoc]:
    """Every key below a node, depth first, each before its own keys."""
    for key in child_keys(path, node):
        yield key
        yield from walk_keys(key.path, key.node)


def is_documented(key: KeyDoc) -> bool:
    """Whether a key gets its own row: all but a bare object (one of free names, no description) that only groups."""
    grouping = "description" not in key.node and "default" not in key.node and format_type(key.node) == "object"
    return not grouping


def render_row(key: KeyDoc) -> str:
    """A table row: key, type, default, description."""
    description = escape_text(key.node.get("description", ""))
    return f"| {code(key.path)} | {format_type(key.node)} | {format_default(key)} | {description} |"


def render_section(name: str, node: Mapping[str, Any]) -> str:
    """One top-level key: heading, description, its type and default, then the table of the keys below it."""
    lines = [f"## `{name}`", ""]
    if "description" in node:
        lines += [" ".join(node["description"].split()), ""]
    lines += [f"Type: {format_type(node)}. Default: {format_default(KeyDoc(name, node))}.", ""]
    rows = [render_row(key) for key in walk_keys(name, node) if is_documented(key)]
    if rows:
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(lines)


def render_contents(schema: Mapping[str, Any]) -> str:
    """A line of links to the sections."""
    links = [f"[`{name}`](#{name.lower()})" for name in schema.get("properties", {})]
    return "Sections: " + " · ".join(links) + "."


def render_reference(schema: Mapping[str, Any]) -> str:
    """The whole reference: header, the schema's own description, contents, one section per top-level key."""
    parts = [HEADER]
    if "description" in schema:
        parts.append(" ".join(schema["description"].split()))
    parts.append(render_contents(schema))
    parts += [render_section(name, node) for name, node in schema.get("properties", {}).items()]
    return "\n\n".join(part.rstrip("\n") for part in parts) + "\n"
