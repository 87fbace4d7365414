"""The project's own style gates: ruff, the type checker mypy (over scripts/rasterscale, settings in pyproject.toml),
the import contracts (import-linter, pyproject.toml), snakefmt and snakemake --lint stay clean; the package's import
graph has no cycle."""

import os
import subprocess
import sys
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
