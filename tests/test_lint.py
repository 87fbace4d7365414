"""The project's own style gates: ruff, the type checker mypy (over scripts/rasterscale, settings in pyproject.toml),
the import contracts (import-linter, pyproject.toml), snakefmt and snakemake --lint stay clean; the package's import
graph has no cycle, and its layers hold for the imports made for the type checker only too."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from conftest import REPO

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        [str(BIN / "ruff"), "check", "scripts", "tests", "bench"],
        [str(BIN / "ruff"), "format", "--check", "scripts", "tests", "bench"],
        [str(BIN / "mypy")],
        [str(BIN / "snakefmt"), "--check", "Snakefile", "rules"],
        [sys.executable, "-m", "snakemake", "--lint", "-n"],
        [str(BIN / "lint-imports"), "pyproject.toml"],
    ],
    ids=["ruff", "ruff-format", "mypy", "snakefmt", "snakemake-lint", "import-contracts"],
)
def test_clean(command):
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_the_package_has_no_import_cycle():
    """No module of rasterscale reaches itself through the modules it imports (at module level or in a function;
    imports under TYPE_CHECKING are for the type checker only)."""
    graph = grimp.build_graph("rasterscale", exclude_type_checking_imports=True)
    assert len(graph.modules) > 50  # the whole package, not an empty graph
    cycles = [
        graph.find_shortest_chain(importer=imported, imported=importer)
        for importer in sorted(graph.modules)
        for imported in graph.find_modules_directly_imported_by(importer)
        if graph.find_shortest_chain(importer=imported, imported=importer)
    ]
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_the_package_layers_hold_with_type_only_imports_too():
    """The package's layers (the first import contract of pyproject.toml) hold for every import, those under
    TYPE_CHECKING included, which import-linter leaves out (the torch-free contract needs them left out: a spec names
    the torch half's types): no module types its arguments with a layer above its own."""
    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    assert contract["type"] == "layers" and contract["layers"][0] == "rasterscale.tools"
    layers = [grimp.Layer(*(name.strip() for name in layer.split("|"))) for layer in contract["layers"]]
    graph = grimp.build_graph("rasterscale", exclude_type_checking_imports=False)
    upward = graph.find_illegal_dependencies_for_layers(layers=layers)
    assert not upward, sorted(f"{d.importer} -> {d.imported}: {d.routes}" for d in upward)[:5]
