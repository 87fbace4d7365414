"""Tile-level resume of prediction: a rank's saved parts of finished tiles, kept where a failed job leaves them.

Snakemake deletes a failed job's declared output folder, so a prediction job (batch b, shard s) keeps its
saved parts beside it, in ``results/{run}/predict/batch-{b}/shard-{s}.resume/``
(:func:`rasterscale.jobs.paths.resume_dir`), and removes that folder once every rank has written its files.
Per scene, rank ``i`` keeps there:

- parts ``{scene}/rank-{i}.part-{k}{suffix}``: what its task's output holds of finished tiles, written since the
  previous part (detection: their boxes; segmentation: finished rows of its class raster), atomically;
- its index ``{scene}/rank-{i}.index.json``, rewritten atomically after each part: the parts in order, the own
  tile_ids each vouches for, and the run's fingerprint (config, model file, world size, shards, tiles).

A rerun with the same fingerprint skips the own tiles the index vouches for (and a task predicts only what the
others need: :meth:`rasterscale.tasks.api.Task.tiles_to_predict`), and its task assembles the rank output from the
parts and the new tiles; with another fingerprint the rank logs one line and starts over. When to write a part:
every ``predict.save_every`` seconds, or sooner when a rank output holds :data:`MAX_UNSAVED_BYTES` of
finished data not in a part yet (:class:`SaveClock`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rasterscale.atomic import write_json
from rasterscale.jobs.paths import rank_stem
from rasterscale.settings import Settings, carried, to_dict
from rasterscale.tasks.spec import Part

RESUME_FORMAT = "rasterscale-resume/1"
MAX_UNSAVED_BYTES = 16 * 2**20  # finished data a rank output holds before a part is written, whatever the clock
# predict keys that do not change what a rank writes (predict.scenes: the job file lists the scenes, whose tiles
# the fingerprint holds; a job's settings leave it out)
IGNORED_PREDICT_KEYS = ("save_every", "scenes")


def file_digest(path: str | Path) -> str:
    """SHA-256 of a model file, or of a model folder (a DeepForest folder: its files' names and bytes)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(partial(handle.read, 2**22), b""):
                digest.update(block)
    return digest.hexdigest()


def prediction_fingerprint(
    settings: Settings,
    model_digest: str,
    world_size: int,
    shards: int,
    shard: int,
    scene_tiles: Sequence[int],
) -> dict[str, Any]:
    """What a rank's saved parts are only valid for: the job's settings (but its save interval), the model
    file's content, the launch geometry and the scene's tile_ids (hashed)."""
    predict = {k: v for k, v in to_dict(settings.predict).items() if k not in IGNORED_PREDICT_KEYS}
    config_text = json.dumps({**carried(settings), "predict": predict}, sort_keys=True, default=str)
    return {
        "config": hashlib.sha256(config_text.encode()).hexdigest(),
        "model file": model_digest,
        "world size": int(world_size),
        "shards": [int(shards), int(shard)],
        "tiles": hashlib.sha256(json.dumps([int(t) for t in scene_tiles]).encode()).hexdigest(),
    }


class RankSaves:
    """One rank's saved parts of one scene (see the module docstring): read once at start, then grown part by
    part."""

    def __init__(self, folder: str | Path, scene: str, index: int, suffix: str, print_: Mapping[str, Any]) -> None:
        self.folder, self.suffix, self.fingerprint = Path(folder), suffix, dict(print_)
        self.stem = Path(rank_stem(folder, scene, index))
        self.parts: list[Part] = []
        self.resumed: set[int] = set()  # own tiles the parts of an earlier run hold

    @property
    def index_path(self) -> Path:
        return self.stem.with_name(f"{self.stem.name}.index.json")

    @property
    def done(self) -> set[int]:
        return {tile for part in self.parts for tile in part.tiles}

    def load(self, logger: logging.Logger) -> list[Part]:
        """The parts a previous run of this rank left, when its fingerprint is this run's and every part is
        there; otherwise none (logging why, in one line) and the old ones removed."""
        if not self.index_path.exists():
            self.clear()
            return []
        try:
            index = json.loads(self.index_path.read_text())
            if index.get("format") != RESUME_FORMAT:
                raise ValueError("not a rasterscale resume index")
            parts = [
                Part(self.index_path.parent / p["file"], list(p["tiles"]), p.get("meta", {})) for p in index["parts"]
            ]
        except (ValueError, KeyError, TypeError) as err:
            logger.warning("resume: %s unreadable (%s); starting over", self.index_path, err)
            self.clear()
            return []
        differ = [key for key in self.fingerprint if index.get("fingerprint", {}).get(key) != self.fingerprint[key]]
        missing = [part.path.name for part in parts if not part.path.exists()]
        if differ or missing:
            why = f"made with another {', '.join(differ)}" if differ else f"part(s) missing: {', '.join(missing)}"
            logger.warning("resume: %s %s; starting over", self.index_path, why)
            self.clear()
            return []
        self.parts = parts
        self.resumed = self.done
        return parts

    def clear(self) -> None:
        """Remove this rank's parts and index of the scene (never another rank's)."""
        self.parts, self.resumed = [], set()
        if self.stem.parent.is_dir():
            for path in self.stem.parent.glob(f"{self.stem.name}.part-*"):
                path.unlink()
        self.index_path.unlink(missing_ok=True)

    def next_part_path(self) -> Path:
        return self.stem.with_name(f"{self.stem.name}.part-{len(self.parts):05d}{self.suffix}")

    def commit(self, part: Part) -> None:
        """Record a part written (atomically) at :meth:`next_part_path`: the index is rewritten atomically after
        it, so an index names only complete parts."""

        self.parts.append(part)
        parts = [{"file": p.path.name, "tiles": [int(t) for t in p.tiles], "meta": p.meta} for p in self.parts]
        write_json({"format": RESUME_FORMAT, "fingerprint": self.fingerprint, "parts": parts}, self.index_path)


class SaveClock:
    """When a rank writes parts: ``every`` seconds after its previous ones (0: after every batch)."""

    def __init__(self, every: float) -> None:
        self.every, self.last = float(every), time.monotonic()

    def due(self, unsaved_bytes: int = 0) -> bool:
        return time.monotonic() - self.last >= self.every or unsaved_bytes >= MAX_UNSAVED_BYTES

    def reset(self) -> None:
        self.last = time.monotonic()


def remove_resume_dir(folder: str | Path) -> None:
    """Remove a job's saved parts, once every rank has written its files."""
    shutil.rmtree(folder, ignore_errors=True)
