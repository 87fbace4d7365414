"""The package's structure: no function or method of scripts/rasterscale is longer than :data:`MAX_FUNCTION_LINES`
lines, from its ``def`` line to its last line (decorators aside), so that each reads as one unit."""

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "scripts" / "rasterscale"
MAX_FUNCTION_LINES = 60


def function_lengths(source: str) -> Iterator[tuple[str, int]]:
    """Every function and method of a module's source (nested ones too), as its qualified name (``Class.method``,
    ``function.inner``) and its length in lines: ``end_lineno - lineno + 1`` of its ``def``."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None  # ast.parse sets it
                yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


def long_functions(root: Path, limit: int) -> list[str]:
    """``path:function (lines)`` of every function under ``root`` longer than ``limit`` lines, path relative to
    the repository."""
    return [
        f"{path.relative_to(REPO)}:{name} ({lines})"
        for path in sorted(root.rglob("*.py"))
        for name, lines in function_lengths(path.read_text())
        if lines > limit
    ]


def test_lengths_run_from_def_to_the_last_line_of_each_function_and_method():
    source = (
        "@decorated\n"
        "def outer():\n"  # lines 2-8: 7
        "    def inner():\n"  # lines 3-4: 2
        "        return 1\n"
        "    x = 1\n"
        "\n"
        "    # a comment\n"
        "    return inner\n"
        "class Kind:\n"
        "    def method(self):\n"  # lines 10-11: 2
        "        pass\n"
        "async def waits(): ...\n"  # line 12: 1
    )
    assert list(function_lengths(source)) == [("outer", 7), ("outer.inner", 2), ("Kind.method", 2), ("waits", 1)]


def test_no_function_or_method_of_the_package_is_longer_than_the_limit():
    offenders = long_functions(PACKAGE, MAX_FUNCTION_LINES)
    assert not offenders, f"{len(offenders)} function(s) over {MAX_FUNCTION_LINES} lines: " + ", ".join(offenders)
