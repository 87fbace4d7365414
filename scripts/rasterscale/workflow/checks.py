"""Checks of the working directory the workflow writes into."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

WORKFLOW_FOLDERS = ("results", "results/models", "logs", "benchmarks", ".snakemake")


def unwritable_folder(workdir: str | Path = ".", others: Sequence[str | Path] = ()) -> Path | None:
    """The first folder the workflow writes into that it cannot (the working directory, its results/, logs/,
    benchmarks/, .snakemake/ and ``others`` where they exist), or None."""
    workdir = Path(workdir)
    for folder in [workdir, *(workdir / name for name in WORKFLOW_FOLDERS), *map(Path, others)]:
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return folder
    return None
