"""Rank files' bookkeeping, whatever the task: which tiles a rank processed, and its profile.

Each prediction rank writes, per scene, its task's output (``rank-{i}.parquet`` of detections, ``rank-{i}.tif`` of
classes, ...) and then, as the last step, its record ``rank-{i}.json``: the tile_ids it processed (also those that
gave nothing), its profile (:mod:`rasterscale.predict.profile`) and how many of them an earlier run of the rank had
saved (:mod:`rasterscale.jobs.resume`). The record is written after the output, atomically,
so a record on disk means a complete output beside it. The merge checks from the records that the processed
tile_ids are the manifest's, each exactly once, before it reads any output.

A scene's rank files live in the folder of the (batch, shard) job that wrote them:
``results/{run}/predict/batch-{b}/shard-{s}/{scene}/rank-{i}.*`` (:func:`rasterscale.jobs.paths.rank_stem`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rasterscale.atomic import write_json

RECORD_FORMAT = "rasterscale-rank-record/1"


class TileAccountingError(ValueError):
    """Processed tiles differ from the manifest: a tile is missing, duplicated or unknown."""


def record_path(stem: str | Path) -> Path:
    return Path(f"{stem}.json")


def write_rank_record(
    stem: str | Path, tile_ids: Sequence[int], profile: Mapping[str, Any] | None = None, resumed: int = 0
) -> Path:
    """Write the record of a rank's output ``{stem}.*`` (atomically): its processed tile_ids, its profile (of
    this run's prediction) and how many of the tiles came from an earlier run's saved parts
    (:mod:`rasterscale.jobs.resume`)."""

    path = record_path(stem)
    record = {"format": RECORD_FORMAT, "tile_ids": [int(t) for t in tile_ids], "profile": profile, "resumed": resumed}
    write_json(record, path)
    return path


def read_rank_record(stem: str | Path) -> dict[str, Any]:
    path = record_path(stem)
    if not path.exists():
        raise TileAccountingError(f"{path}: rank record missing (the rank did not finish writing its output)")
    record = json.loads(path.read_text())
    if record.get("format") != RECORD_FORMAT:
        raise TileAccountingError(f"{path}: not a rasterscale rank record")
    return record


def read_tile_ids(stem: str | Path) -> np.ndarray:
    return np.asarray(read_rank_record(stem)["tile_ids"], dtype=np.int64)


def read_profiles(stems: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The profiles of a scene's rank records (those written with one)."""
    return [p for p in (read_rank_record(stem)["profile"] for stem in stems) if p is not None]


def _ids_text(ids: np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:limit])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


def check_exactly_once(manifest_ids: np.ndarray, processed: Mapping[str, np.ndarray]) -> None:
    """Raise TileAccountingError naming the tiles that are missing, duplicated or not in the manifest."""
    all_ids = np.concatenate([np.asarray(v, dtype=np.int64) for v in processed.values()] or [np.zeros(0, int)])
    ids, counts = np.unique(all_ids, return_counts=True)
    duplicated = ids[counts > 1]
    missing = np.setdiff1d(np.asarray(manifest_ids), ids)
    unknown = np.setdiff1d(ids, np.asarray(manifest_ids))
    problems = []
    if len(missing):
        problems.append(f"missing tile_id(s) {_ids_text(missing)}")
    if len(duplicated):
        where = {
            int(t): [Path(p).name for p, v in processed.items() if int(t) in set(np.asarray(v).tolist())]
            for t in duplicated[:3]
        }
        problems.append(f"duplicated tile_id(s) {_ids_text(duplicated)} (e.g. {where})")
    if len(unknown):
        problems.append(f"tile_id(s) not in the manifest {_ids_text(unknown)}")
    if problems:
        raise TileAccountingError("tile accounting failed: " + "; ".join(problems))


def check_scene_records(stems: Sequence[str | Path], manifest_ids: np.ndarray) -> None:
    """Every rank record of a scene exists and, together, they cover the manifest's tiles exactly once."""
    check_exactly_once(manifest_ids, {str(record_path(stem)): read_tile_ids(stem) for stem in stems})
