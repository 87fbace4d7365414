"""docs/configuration.md is the schema rendered (never stale), and names every key of the schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conftest import REPO, schema_keys
from rasterscale.config.schema import load_schema
from rasterscale.tools.configdoc import escape_text, format_type, format_value, render_reference

REFERENCE = REPO / "docs" / "configuration.md"


def test_reference_is_generated_from_schema():
    expected = render_reference(load_schema())
    assert REFERENCE.read_text() == expected, "docs/configuration.md is stale: run `make docs`"


def test_every_schema_key_appears():
    text = REFERENCE.read_text()
    schema = load_schema()
    paths = [path for path, _ in schema_keys("", schema)]
    assert len(paths) > 60
    missing = [path for path in paths if not _documented(text, schema, path)]
    assert not missing, f"keys missing from docs/configuration.md (run `make docs`): {missing}"


def _documented(text: str, schema: Mapping[str, Any], path: str) -> bool:
    """A section heading for a top-level key, a table row for any other (a bare group of free names needs none)."""
    if "." not in path:
        return f"## `{path}`" in text
    grouping = path.endswith("{name}") and "description" not in _node(schema, path)
    return grouping or f"| `{path}` |" in text


def _node(schema: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    node: Mapping[str, Any] = schema
    for name in path.split("."):
        node = node["additionalProperties"] if name == "{name}" else node["properties"][name]
    return node


def test_defaults_and_descriptions_render():
    text = REFERENCE.read_text()
    assert "| `tiling.patch_size` | integer, ≥ 32 | `400` | Tile side in pixels (the model's input size). |" in text
    assert '| `model.file` | string | `""` |' in text
    assert "| `scenes.{name}.path` | string | required |" in text
    assert "| `model.resize.min_size` | integer, ≥ 16 | required |" in text


def test_format_helpers():
    assert format_value(None) == "null"
    assert format_value(True) == "true"
    assert format_value("") == '""'
    assert format_value([1, 2, 3]) == "[1, 2, 3]"
    assert format_value({}) == "{}"
    assert format_type({"type": ["integer", "null"], "minimum": 0, "maximum": 1}) == "integer or null, 0–1"
    assert format_type({"enum": [None, "a"]}) == "one of `null`, `a`"
    assert escape_text("a <b> | `x|y` *c") == r"a &lt;b> \| `x\|y` \*c"
