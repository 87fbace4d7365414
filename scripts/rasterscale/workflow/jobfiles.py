"""A batch's job file (``results/batches/batch-{batch}.json``, rule scene_batch): what the jobs of a batch of
scenes read (each scene's raster, manifest, imagery keys, rank files and outputs), from a file rather than a
command line that would grow with the batch. This module imports no torch: the rule's job starts in a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rasterscale.atomic import atomic_path


@dataclass(frozen=True)
class SceneJob:
    """One scene of a prediction job, as its job file lists it: raster and tile manifest."""

    name: str
    raster: str
    manifest: str


def write_job_file(job: str, path: str | Path, log: str | Path) -> None:
    """Write a batch's job file (``job``: its JSON) atomically, and one line naming its scenes into ``log``."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(job + "\n")
    scenes = json.loads(job)["scenes"]
    Path(log).write_text(f"{path}: {len(scenes)} scene(s): {', '.join(s['name'] for s in scenes)}\n")


def read_job_file(path: str | Path) -> list[SceneJob]:
    """The scenes of a batch's job file, in order."""
    scenes = json.loads(Path(path).read_text())["scenes"]
    return [SceneJob(s["name"], s["raster"], s["manifest"]) for s in scenes]
