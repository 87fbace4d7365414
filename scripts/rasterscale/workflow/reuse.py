"""The main process's plan, reused while nothing it read changed.

Every invocation of Snakemake plans (a dry run, a run, the main process of a cluster run): it validates the config,
checks every scene's inputs (:mod:`rasterscale.workflow.checks`) and writes the jobs' files
(:mod:`rasterscale.workflow.jobfiles`). At 100,000 scenes that is about a minute and a half, the same again when
nothing changed. So when the main process has stored its plan (:mod:`rasterscale.workflow.storage`) and written the
job files, it records beside them (:class:`PlanRecord`, ``plan-{key}/main.json``) what the plan's building read
(:func:`rasterscale.workflow.checks.watched_inputs`: the scenes' rasters, annotations and STAC items, the model
files, the scene table or a glob's matches, the rasters' folders, the run's records of left-out scenes and of
batches), each by size and mtime, the job files it wrote, the warnings it gave, and what the plan holds for the
main process only (the headers it trusted, the scenes it left out).

The next invocation of the same config (the same key) loads that plan instead of building it when the record is
of this code (:func:`code_version`: the package's sources, rasterio's and GDAL's versions) and of the stored plan
(its text's hash), and every watched input is as recorded; it says the recorded warnings again, and writes no job
file when each is as it wrote it (else it writes them as always: only those whose content changed). A plan whose
building read what no stat watches (a remote file, a remote or VRT raster not trusted from its STAC item) gets no
record: it is built every time. A file rewritten with its size and mtime kept (within the file system's timestamp
resolution) is not seen, as by the header cache and a job's stored plan.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rasterio

from rasterscale.config.schema import SCHEMA_PATH
from rasterscale.jobs import paths
from rasterscale.raster.item_header import ItemHeader
from rasterscale.workflow.checks import (
    GLOB,
    SIBLINGS,
    build_plan,
    check_writable,
    watch_value,
    watched_inputs,
)
from rasterscale.workflow.jobfiles import write_each_job_file
from rasterscale.workflow.jsonshape import Row, check_shape
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.storage import (
    UNREADABLE,
    OtherFormat,
    damaged,
    fingerprint,
    plan_from_json,
    plan_to_json,
    store_cache_text,
    store_plan_text,
)

FORMAT = 1  # of a record: a record of another format is not used
PREFIXED = (GLOB, SIBLINGS)  # watched keys whose values are no file's [size, mtime_ns]
RECORD = "main.json"  # in the stored plan's folder (beside its batch plans)
PACKAGE = Path(__file__).resolve().parents[1]  # scripts/rasterscale
# a record's JSON as PlanRecord.to_json writes it (rasterscale.workflow.jsonshape's notation); a watched
# input's version is whatever watch_value gives (compared, never read), a trusted header ItemHeader.from_dict checks
RECORD_SHAPE: dict[str, Any] = {
    "code": str,
    "workdir": str,
    "digest": str,
    "watched": dict,
    "jobs": {str: (Row(int, int), None)},
    "warnings": [str],
    "trusted": {str: dict},
    "skipped": {str: str},
}


@functools.cache
def code_version() -> str:
    """What tells this rasterscale's plans from another's: a hash of the package's sources and its config schema,
    with Python's, rasterio's and GDAL's versions."""
    digest = hashlib.sha256(f"{sys.version} {rasterio.__version__} {rasterio.__gdal_version__}".encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(f"{path.relative_to(PACKAGE)}\0".encode())
        digest.update(path.read_bytes())
    digest.update(SCHEMA_PATH.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class PlanRecord:
    """What the main process's plan of a key read and wrote (see the module)."""

    code: str  # code_version()
    workdir: str  # the working directory, resolved (a copy of it elsewhere, times kept, names other files)
    digest: str  # the stored plan's text's hash
    watched: dict[str, Any]  # input -> its version (rasterscale.workflow.checks.watch_value)
    jobs: dict[str, list[int] | None]  # job file -> [size, mtime_ns] as written
    warnings: tuple[str, ...]  # what the plan's building said, in order
    trusted: dict[str, ItemHeader]  # Plan.trusted
    skipped: dict[str, str]  # Plan.skipped

    def to_json(self) -> str:
        data = {
            "format": FORMAT,
            "code": self.code,
            "workdir": self.workdir,
            "digest": self.digest,
            "watched": self.watched,
            "jobs": self.jobs,
            "warnings": list(self.warnings),
            "trusted": {name: header.to_dict() for name, header in self.trusted.items()},
            "skipped": self.skipped,
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PlanRecord:
        """The record of :meth:`to_json`'s JSON; an :class:`OtherFormat` when it is of another format, a ValueError
        (or KeyError, TypeError...) when it is no such JSON: cut short, or of another shape (:data:`RECORD_SHAPE`)."""
        data = json.loads(text)
        check_shape(data, dict, "the file")
        if data.get("format") != FORMAT:
            raise OtherFormat(f"record of format {data.get('format')}, not {FORMAT}")
        check_shape(data, RECORD_SHAPE, "")
        trusted = {name: ItemHeader.from_dict(header) for name, header in data["trusted"].items()}
        return cls(
            data["code"],
            data["workdir"],
            data["digest"],
            data["watched"],
            data["jobs"],
            tuple(data["warnings"]),
            trusted,
            dict(data["skipped"]),
        )

    def unchanged(self, workdir: Path) -> bool:
        """Whether every watched input is as recorded."""
        return all(watch_value(key, workdir) == value for key, value in self.watched.items())

    def jobs_unchanged(self, workdir: Path) -> bool:
        """Whether every job file is as written."""
        return all(watch_value(path, workdir) == stat for path, stat in self.jobs.items())


def record_path(key: str, workdir: str | Path = ".") -> Path:
    return Path(workdir) / paths.stored_batch_plans(key) / RECORD


def main_plan(raw: Mapping[str, Any], workdir: str | Path = ".", warn: Callable[[str], None] | None = None) -> Plan:
    """The main process's plan of the raw config, its job files written: the stored one reused when its record
    holds (see the module), else built with every check (headers through the header cache) and stored, and the
    record written anew. ``warn`` gets each warning, a reused plan's recorded ones too."""
    base = Path(workdir)
    say = warn if warn is not None else _silent
    key = fingerprint(raw)
    started = time.time_ns()
    reused = reusable(key, base, say)
    if reused is not None:
        plan, record = reused
        for line in record.warnings:
            say(line)
        check_writable(plan.settings, base)
        if record.jobs_unchanged(base):
            return plan
        digest, warnings = record.digest, record.warnings
    else:
        plan, digest, warnings = build_and_store(raw, key, base, say)
    jobs = {path: watch_value(path, base) for path, _ in write_each_job_file(plan, base)}
    watched = watched_inputs(plan, raw, base)
    if watched is None or _changed_since(watched, started, plan.paths.jobs_dir("tiles")):
        record_path(key, base).unlink(missing_ok=True)  # built again next time
        return plan
    where = str(base.resolve())
    record = PlanRecord(code_version(), where, digest, watched, jobs, warnings, plan.trusted, plan.skipped)
    store_cache_text(record.to_json(), record_path(key, base), say)
    return plan


def _changed_since(watched: Mapping[str, Any], started: int, written: str) -> bool:
    """Whether a watched input (but the folder of job files this process ``written``) changed after ``started``
    (ns): while the plan was built (a job of a run beside this dry run recorded a scene it left out); its version
    then may not be the one the plan read."""
    stats = (value for key, value in watched.items() if key != written and not key.startswith(PREFIXED) and value)
    return any(mtime >= started for _, mtime in stats)


def build_and_store(
    raw: Mapping[str, Any], key: str, workdir: Path, say: Callable[[str], None]
) -> tuple[Plan, str, tuple[str, ...]]:
    """Build the plan with every check and store it under ``key`` (its record removed first: it is of the plan
    replaced); the plan, its stored text's hash and the warnings its checks gave (each said as it comes)."""
    said: list[str] = []

    def told(line: str) -> None:
        said.append(line)
        say(line)

    record_path(key, workdir).unlink(missing_ok=True)
    plan = build_plan(raw, workdir, told, cache_headers=True)
    text = plan_to_json(plan)
    store_plan_text(text, key, workdir, say)
    return plan, _digest(text), tuple(said)


def reusable(key: str, workdir: Path, warn: Callable[[str], None] | None = None) -> tuple[Plan, PlanRecord] | None:
    """The plan stored under ``key`` with its record, when the record is of this code and that plan and every
    input it watches is as recorded; else None. A record, or the plan it records, that cannot be read (cut short,
    not what was written) is removed with one warning (``warn``): the plan is then built again."""
    path = record_path(key, workdir)
    try:
        record = PlanRecord.from_json(path.read_text())
    except (FileNotFoundError, OtherFormat):
        return None
    except UNREADABLE as err:
        damaged(path, "stored plan's record", err, warn)
        return None
    if (record.code, record.workdir) != (code_version(), str(workdir.resolve())) or not record.unchanged(workdir):
        return None
    stored = workdir / paths.stored_plan(key)
    try:
        plan_text = stored.read_text()
        if _digest(plan_text) != record.digest:
            raise ValueError("not the plan its record was written for: cut short or changed")
        plan = plan_from_json(plan_text)
    except UNREADABLE as err:
        path.unlink(missing_ok=True)
        damaged(stored, "stored plan", err, warn)
        return None
    return plan.with_(trusted=record.trusted, skipped=record.skipped), record


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _silent(line: str) -> None:
    pass
