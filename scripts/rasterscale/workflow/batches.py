"""Batches of scenes that stay put: which prediction job predicts which scenes (and seams).

A batch's tiles job file (``results/{run}/jobs/tiles/batch-{b}.json``, written with the plan's other job files
before the DAG: :mod:`rasterscale.workflow.jobfiles`) records its members. When the workflow plans again, every
recorded batch whose members the plan would still write as recorded is kept as it is, under its number: its jobs'
inputs do not change, so Snakemake redoes none of them. Only members in no kept batch (new scenes and seams, or
those whose entry changed: another raster, imagery keys, shards) form new batches, ``size`` scenes at a time with
the seams they bring, numbered with the smallest free numbers. So adding scenes predicts only them, and removing
or reordering scenes redoes nothing that stays: a kept batch goes on listing a scene the config no longer names
(its outputs are simply not asked for), as long as that scene's rasters still exist.

When two recorded files claim a member (a batch that was formed again), the newer file wins.

Each of a batch's jobs (its tile manifests, its merge, its scoring) writes a record last
(``RunPaths.batch_record``), and what reads a batch's files depends on that one file: a DAG of 10,000 scenes would
otherwise look up the producer of every scene's files (tens of seconds). Snakemake remakes a job's missing output
only when something asks for that very file, so the targets also name the files that a recorded job wrote and
are gone (:func:`recorded_targets`), looked for only in the folders changed since the job's record
(:func:`missing_since`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasterscale.grid.project import is_seam, seam_scenes
from rasterscale.jobs.files import MergeJob, ScoreJob, TilesJob
from rasterscale.scene import Scene

BATCH_FILE = re.compile(r"^batch-(\d+)\.json$")


@dataclass(frozen=True)
class WrittenBatch:
    """A batch's job file as found on disk: its number, its time of writing and its scenes' entries."""

    batch: int
    mtime_ns: int
    scenes: tuple[dict[str, Any], ...]


def read_written_batches(jobs_dir: str, workdir: str | Path = ".") -> list[WrittenBatch]:
    """The batches' tiles job files in a run's ``jobs_dir`` (``results/{run}/jobs/tiles/``; unreadable ones are left
    out: formed again)."""
    folder = Path(workdir) / jobs_dir
    recorded = []
    for path in folder.glob("batch-*.json") if folder.is_dir() else ():
        match = BATCH_FILE.match(path.name)
        if not match:
            continue
        try:
            data = json.loads(path.read_text())
            scenes = tuple(dict(entry) for entry in data["scenes"])
            recorded.append(WrittenBatch(int(match.group(1)), path.stat().st_mtime_ns, scenes))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return recorded


def form_batches(
    members: Sequence[str],
    entry: Callable[[str, int], Scene],
    size: int,
    recorded: Sequence[WrittenBatch],
    exists: Callable[[str], bool],
) -> tuple[dict[int, tuple[str, ...]], dict[str, Scene]]:
    """The batches, by number, their members by name: the recorded ones kept (see the module docstring), then the
    other ``members`` in their order, ``size`` scenes at a time with their seams (:func:`new_batches`); and the
    recorded entries of the kept batches' members that ``members`` no longer names (any other member's entry is
    ``entry(member, batch)``, what the plan writes for it). ``exists(raster)``: whether a raster a kept batch reads
    is still there."""
    wanted = set(members)
    kept: dict[int, tuple[str, ...]] = {}
    unwanted: dict[int, dict[str, Scene]] = {}
    claimed: set[str] = set()
    for record in sorted(recorded, key=lambda r: (-r.mtime_ns, r.batch)):
        names = tuple(scene["name"] for scene in record.scenes)
        if record.batch in kept or claimed.intersection(names) or not _still_valid(record, wanted, entry, exists):
            continue
        kept[record.batch] = names
        unwanted[record.batch] = {s["name"]: Scene.from_dict(s) for s in record.scenes if s["name"] not in wanted}
        claimed.update(names)
    batches = {number: kept[number] for number in sorted(kept) if wanted.intersection(kept[number])}
    entries = {name: scene for number in batches for name, scene in unwanted[number].items()}
    rest = [name for name in members if name not in claimed]
    free = (number for number in range(len(kept) + len(rest) + 1) if number not in batches)
    for chunk in new_batches(rest, size):
        batches[next(free)] = tuple(chunk)
    return dict(sorted(batches.items())), entries


def new_batches(rest: Sequence[str], size: int) -> list[list[str]]:
    """The new members in batches of ``size`` scenes, each with the seams its scenes bring (a seam is a band of
    tiles, not a scene's worth): a seam joins the batch of its second scene, else of its first, else the last."""
    scenes = [name for name in rest if not is_seam(name)]
    chunks = [scenes[start : start + size] for start in range(0, len(scenes), size)]
    home = {name: index for index, chunk in enumerate(chunks) for name in chunk}
    for seam in (name for name in rest if is_seam(name)):
        if not chunks:
            chunks.append([])
        a, b = seam_scenes(seam)
        chunks[home.get(b, home.get(a, len(chunks) - 1))].append(seam)
    return chunks


def _still_valid(
    record: WrittenBatch, wanted: set[str], entry: Callable[[str, int], Scene], exists: Callable[[str], bool]
) -> bool:
    """A recorded batch holds: every member still wanted is recorded as the plan would write it, and every member
    no longer wanted still has its rasters."""
    for scene in record.scenes:
        if scene["name"] in wanted:
            if entry(scene["name"], record.batch).to_dict() != scene:
                return False
        elif not all(exists(raster) for raster in Scene.from_dict(scene).rasters):
            return False
    return True


# -- the per-batch rules a parse defines ----------------------------------------------------------------------------

# a run predicting more scenes than this declares, of its scoring jobs' files, only those gone since they ran (as
# the other batch rules always do: rasterscale.workflow.steps.base.RecordedStep.declared_files), and its report
# shows no scene's pages: 5 a scene
REPORTED_SCENES = 1000
# the steps with a rule a batch, {step}_batch_{b} (rasterscale.workflow.steps.base.BatchStep): by their names
BATCH_RULES = (TilesJob.KIND, MergeJob.KIND, ScoreJob.KIND)
BATCH_RULE = re.compile(rf"^(?:{'|'.join(BATCH_RULES)})_batch_(\d+)$")


def batch_rule(kind: str, batch: int) -> str:
    """The name of a batch's rule of a kind in :data:`BATCH_RULES`."""
    if kind not in BATCH_RULES:
        raise ValueError(f"no per-batch rule '{kind}' ({', '.join(BATCH_RULES)})")
    return f"{kind}_batch_{batch}"


def allowed_rules(argv: Sequence[str]) -> frozenset[str] | None:
    """The rules a Snakemake process was told to consider (``--allowed-rules A B ...``, which Snakemake gives the
    command of every job it spawns), None when it was not."""
    given = any(arg == "--allowed-rules" or arg.startswith("--allowed-rules=") for arg in argv)
    return frozenset(_option_values(argv, "--allowed-rules")) if given else None


def job_batch(argv: Sequence[str]) -> int | None:
    """The batch a spawned job belongs to, from its command line (``--target-jobs RULE:WILDCARDS ...``, which
    Snakemake gives every job it spawns): that of a batch rule (``merge_batch_3:``) or of a rule's ``batch``
    wildcard (``predict:batch=3,shard=0``); None when its jobs are of no batch or of several (a group job)."""
    found = set()
    for spec in _option_values(argv, "--target-jobs"):
        rule, _, wildcards = spec.partition(":")
        match = BATCH_RULE.match(rule)
        values = dict(item.partition("=")[::2] for item in wildcards.split(",") if item)
        number = match.group(1) if match else values.get("batch")
        if number is None or not number.isdigit():
            return None
        found.add(int(number))
    return found.pop() if len(found) == 1 else None


def _option_values(argv: Sequence[str], option: str) -> list[str]:
    """The values given to a command line's option of several values (``--option A B ...``)."""
    for index, arg in enumerate(argv):
        if arg == option:
            values = []
            for value in argv[index + 1 :]:
                if value.startswith("-"):
                    break
                values.append(value)
            return values
        if arg.startswith(f"{option}="):
            return arg.split("=", 1)[1].split()
    return []


def rule_batches(numbers: Sequence[int], main_process: bool, argv: Sequence[str]) -> list[int]:
    """The batches whose rules a parse defines: every batch in the main process; in a job's re-parse (cluster or
    subprocess) only those of its allowed rules, so that its parse does not grow with the number of batches (the
    DAG of a job considers its allowed rules only, and the files other rules make already exist)."""
    allowed = None if main_process else allowed_rules(argv)
    if allowed is None:
        return list(numbers)
    wanted = {int(match.group(1)) for match in map(BATCH_RULE.match, allowed) if match}
    return [number for number in numbers if number in wanted]


def recorded_targets(files_of_records: Mapping[str, Sequence[str]], workdir: str | Path = ".") -> list[str]:
    """Targets standing for batch jobs' files: each record (with the files its job writes besides it) and, of a
    record that exists, the files that do not (their job runs again: :func:`missing_since`). A job without its
    record runs anyway."""
    root = str(workdir)
    targets = []
    for record, files in files_of_records.items():
        targets.append(record)
        targets += missing_files(record, files, root)
    return targets


def missing_files(record: str, files: Sequence[str], workdir: str | Path = ".") -> list[str]:
    """Of the files a job writes before its ``record``, those gone since it wrote the record (none while it has
    not: the job runs anyway)."""
    root = str(workdir)
    written = mtime_ns(os.path.join(root, record))
    return [] if written is None else missing_since(files, written, root)


def missing_since(files: Sequence[str], written: int, root: str = ".") -> list[str]:
    """Of the ``files`` a job wrote before its record (written at ``written``, ns), those that do not exist. A
    folder whose mtime is before the record's has lost none of them: removing, adding or renaming an entry sets a
    folder's mtime, and the job's files were there when it wrote its record (Snakemake checks a job's outputs). So
    only the files of a folder changed since are looked at: one stat a folder instead of one a file (a 200,000-scene
    project's jobs write millions of files, which a stat each would cost ~3.5 us apiece on every plan)."""
    by_folder: dict[str, list[str]] = {}
    for path in files:
        by_folder.setdefault(os.path.dirname(path), []).append(path)
    gone = []
    for folder, paths in by_folder.items():
        changed = mtime_ns(os.path.join(root, folder))
        if changed is None or changed >= written:  # the same tick as the record's: looked at
            gone += [path for path in paths if not os.path.exists(os.path.join(root, path))]
    return gone


# What a batch rule declares when every file must be declared: with Snakemake's default storage only the declared
# files go to the bucket (rasterscale.workflow.default_storage), so there a batch's rule declares all of its files.
EVERY_FILE: frozenset[str] = frozenset({"<every file of the batch>"})


def requested_files(argv: Sequence[str], workdir: str | Path = ".") -> frozenset[str]:
    """The words of a Snakemake command line that may be files it asks for, as paths relative to ``workdir``: a
    batch rule declares those of its files (with the files gone:
    :meth:`rasterscale.workflow.steps.base.RecordedStep.declared_files`) so that
    ``snakemake results/{run}/{scene}/detections.gpkg`` finds its producer."""
    base = os.path.abspath(workdir)
    words = [word for word in argv[1:] if word and not word.startswith("-")]
    return frozenset(os.path.relpath(word, base) if os.path.isabs(word) else os.path.normpath(word) for word in words)


def mtime_ns(path: str) -> int | None:
    """A file's or folder's mtime (ns), None when it does not exist."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
