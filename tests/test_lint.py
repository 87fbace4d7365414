"""The project's own style gates: ruff, the type checker mypy (over scripts/rasterscale, settings in pyproject.toml),
snakefmt and snakemake --lint stay clean."""

import subprocess
import sys
from pathlib import Path

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
    ],
    ids=["ruff", "ruff-format", "mypy", "snakefmt", "snakemake-lint"],
)
def test_clean(command):
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
