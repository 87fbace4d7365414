"""The stored plan: a plan is stored as JSON under ``.snakemake/rasterscale/plan-{fingerprint}.json``
(:func:`store_plan`), the fingerprint a hash of the raw config; with it the files its checks read, by size and
mtime. The main Snakemake process stores it when it builds it (:mod:`rasterscale.workflow.reuse`: it reuses it
while nothing it read changed); a job's re-parse (cluster or subprocess) loads it (:func:`load_plan`) instead of
reading every header again, and builds it itself when none is stored for its config or an input changed since
(:func:`job_plan`).

Beside it, each batch's plan (:func:`plan_of_batch`, ``plan-{fingerprint}/batch-{b}.json``): what the jobs of one
batch read, a few hundred kilobytes whatever the project's size. A job of one batch (its tile manifests,
prediction, merge, scoring, partition: Snakemake names it on the job's command line, ``--target-jobs``) loads its
batch's plan, so that its parse does not grow with the project (at 200,000 scenes the whole plan is hundreds of
megabytes of JSON); the other jobs (training, the project's summary, the report) load the whole one.

Every file of the stored plan is written atomically; where the file system is full, it is not stored, with one
warning line (:func:`store_cache_text`), and what its path held (of an older plan) is removed: the plan is built
again where it is needed, never read stale.

The main process's plan reads the scenes' headers through the header cache (``.snakemake/rasterscale/headers.sqlite``,
:mod:`rasterscale.raster.header_cache`), so its next invocation reads only those of rasters that changed; a job's
does not use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rasterscale.atomic import DiskFullError, atomic_path
from rasterscale.grid.partitions import Neighbourhood
from rasterscale.grid.project import Footprint, Seam, is_seam, seam_scenes
from rasterscale.jobs import paths
from rasterscale.raster.bands import InputBands
from rasterscale.runtime.preflight import Geometry
from rasterscale.scene import Scene
from rasterscale.settings import config_of_scenes
from rasterscale.workflow import partitions
from rasterscale.workflow.batches import job_batch
from rasterscale.workflow.checks import build_plan, checked_scene_files, file_stat, run_files
from rasterscale.workflow.jsonshape import Row, check_shape
from rasterscale.workflow.plan import Plan

FORMAT = 7  # of a stored plan: a plan stored in another format is rebuilt


def fingerprint(raw: Mapping[str, Any]) -> str:
    """The stored plan's key: a hash of the raw config (and the plan's format)."""
    text = json.dumps({"format": FORMAT, "config": raw}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


KEPT_PLANS = 8  # stored plans kept (the newest): one per config a working folder ran with lately


Warn = Callable[[str], None]


def store_plan(plan: Plan, key: str, workdir: str | Path = ".", warn: Warn | None = None) -> Path | None:
    """Write the plan atomically under ``.snakemake/rasterscale/plan-{key}.json``, and remove all but the newest
    :data:`KEPT_PLANS` stored plans with their folders (batch plans, the main process's record: a job that finds its
    plan gone builds it again); its path, or None where the file system is full (:func:`store_cache_text`)."""
    return store_plan_text(plan_to_json(plan), key, workdir, warn)


def store_plan_text(text: str, key: str, workdir: str | Path = ".", warn: Warn | None = None) -> Path | None:
    """:func:`store_plan` of the plan's JSON (:func:`plan_to_json`)."""
    path = Path(workdir) / paths.stored_plan(key)
    if not store_cache_text(text, path, warn):
        shutil.rmtree(path.with_suffix(""), ignore_errors=True)  # its batch plans and record: of the older plan
        return None
    stored = sorted(path.parent.glob("plan-*.json"), key=_mtime, reverse=True)
    for old in stored[KEPT_PLANS:]:
        if old != path:
            old.unlink(missing_ok=True)
            shutil.rmtree(old.with_suffix(""), ignore_errors=True)
    return path


def store_batch_plans(plan: Plan, key: str, workdir: str | Path = ".", warn: Warn | None = None) -> None:
    """Write each batch's plan beside the plan stored under ``key`` (``plan-{key}/batch-{b}.json``, atomically,
    only when it changed) and remove those of batches the plan no longer has. The main process does when jobs are
    about to run (Snakemake's onstart: a dry run needs none; 10% of one at 100,000 scenes). Where the file system is
    full, the rest are not written, and removed (:func:`store_cache_text`): their jobs load the whole plan, or
    build it."""
    folder = Path(workdir) / paths.stored_batch_plans(key)
    current = set()  # the files that hold this plan's batch plans
    for number in plan.batch_numbers:
        path = folder / f"batch-{number}.json"
        text = plan_to_json(plan_of_batch(plan, number))
        if not (_holds(path, text) or store_cache_text(text, path, warn)):
            break
        current.add(path.name)
    for old in folder.glob("batch-*.json"):
        if old.name not in current:
            old.unlink(missing_ok=True)


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except (OSError, UnicodeDecodeError):  # absent, or damaged (garbage bytes): written again
        return False


def store_cache_text(text: str, path: Path, warn: Warn | None = None) -> bool:
    """Write a file of the stored plan (the plan, a batch's plan, the main process's record) atomically; whether it
    did. Where the file system is full: one warning line (``warn``, else stderr's), and nothing at ``path`` (what it
    held is of an older plan)."""
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    except DiskFullError as full:
        path.unlink(missing_ok=True)
        line = f"{full.path}: no space left on device ({full.detail}); not stored, the plan is built again where needed"
        (warn or _warn_on_stderr)(line)
        return False
    return True


def _warn_on_stderr(line: str) -> None:
    sys.stderr.write(f"rasterscale: warning: {line}\n")


def plan_of_batch(plan: Plan, batch: int) -> Plan:
    """The plan as the jobs of ``batch`` read it: its members (their entries, scenes, footprints, seams and files),
    its partition's neighbourhood (their scenes' footprints: its memory estimate) and the batches holding it, and
    the training scenes (rules every parse defines read them). Its ``predict.scenes`` lists those of these scenes,
    ``predicted`` counts the whole plan's (the project's size decides which rules there are). What it answers
    about this batch's jobs is what the whole plan answers (tested); about other batches or the whole project it
    knows nothing, and no job of theirs reads it."""
    near = plan.partition_neighbourhoods.get(batch) if partitions.partitioned(plan) else None
    sources = [*near.owners, *near.neighbours] if near is not None else []
    numbers = sorted({batch, *plan.batches_of(sources)})
    members = {number: plan.members[number] for number in numbers}
    names = {*plan.members[batch], *sources}
    scenes = {part for name in names for part in (seam_scenes(name) if is_seam(name) else (name,))}
    scenes.update(plan.train_scenes)
    own = [name for name in sorted(scenes) if name in plan.scenes]
    held = [name for batch_members in members.values() for name in batch_members]
    files = [*run_files(plan.settings), *(f for name in own for f in checked_scene_files(plan.scenes[name]))]
    return Plan(
        config=config_of_scenes(plan.config, own),
        origins={name: plan.origins[name] for name in own if name in plan.origins},
        labels=plan.labels,
        untiled={name: plan.untiled[name] for name in scenes if name in plan.untiled},
        geometry=plan.geometry,
        members=members,
        footprints={name: plan.footprints[name] for name in sorted(scenes) if name in plan.footprints},
        seams=tuple(plan.seams_named(plan.members[batch])),  # a neighbour seam's size is its scenes'
        model_input=plan.model_input,
        inputs={path: plan.inputs[path] for path in files if path in plan.inputs},
        kept={name: plan.kept[name] for name in held if name in plan.kept},
        scope=batch,
        neighbourhoods={batch: near} if near is not None else {},
        predicted=plan.predicted_count,
    )


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def load_plan(key: str, workdir: str | Path = ".", batch: int | None = None, warn: Warn | None = None) -> Plan | None:
    """The plan stored under ``key`` (``batch``: that batch's plan), or None when there is none, it is of another
    format, or a file its checks read changed since (size or mtime; one absent then is the workflow's to make). A
    stored plan that cannot be read (cut short, not a plan) is removed with one warning (``warn``, else stderr's):
    the plan is built again."""
    if batch is None:
        path = Path(workdir) / paths.stored_plan(key)
    else:
        path = Path(workdir) / paths.stored_batch_plans(key) / f"batch-{batch}.json"
    plan = read_stored_plan(path, warn)
    if plan is None:
        return None
    base = Path(workdir)
    # a file absent when the plan was built is one the workflow makes (a demo scene): its appearing changes nothing
    if any(stat is not None and file_stat(base / name) != stat for name, stat in plan.inputs.items()):
        return None
    return plan


def read_stored_plan(path: Path, warn: Warn | None = None) -> Plan | None:
    """The plan stored at ``path``; None when there is none or it is of another format, and, with one warning, when
    it cannot be read (a damaged file is removed)."""
    try:
        plan = plan_from_json(path.read_text())
        plan.paths  # noqa: B018  (its config typed, its run named: one of another shape fails here, not in a rule)
    except (FileNotFoundError, OtherFormat):
        return None
    except UNREADABLE as err:
        damaged(path, "stored plan", err, warn)
        return None
    return plan


def damaged(path: Path, what: str, err: BaseException, warn: Warn | None) -> None:
    """A file of the stored plan that cannot be read: removed, with one warning line naming it and why."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
    reason = (str(err).splitlines() or [type(err).__name__])[0] or type(err).__name__
    (warn or _warn_on_stderr)(f"{path}: the {what} cannot be read ({type(err).__name__}: {reason}); it is built again")


def job_plan(
    raw: Mapping[str, Any],
    workdir: str | Path = ".",
    warn: Callable[[str], None] | None = None,
    argv: Sequence[str] = (),
) -> Plan:
    """The plan of a job's re-parse: the one the main process stored (:mod:`rasterscale.workflow.reuse`; a job of one
    batch, as its command line ``argv`` names it, its batch's plan), else built (without storing it, nor using the
    header cache) when none is stored for its config or it is stale."""
    key = fingerprint(raw)
    batch = job_batch(argv)
    stored = load_plan(key, workdir, batch, warn) if batch is not None else None
    stored = stored or load_plan(key, workdir, warn=warn)
    if stored is not None:
        return stored
    return build_plan(raw, workdir, warn)  # no header cache: a job neither reads nor writes it


def plan_to_json(plan: Plan) -> str:
    """The plan as the JSON :func:`store_plan` writes."""
    data = {
        "format": FORMAT,
        "config": plan.config,
        "notices": list(plan.notices),
        "origins": plan.origins,
        "labels": list(plan.labels),
        "untiled": {name: list(files) for name, files in plan.untiled.items()},
        "geometry": {s: [g.section, g.devices, g.nodes, g.shards] for s, g in plan.geometry.items()},
        "members": [[number, list(names)] for number, names in plan.members.items()],
        "kept": [scene.to_dict() for scene in plan.kept.values()],
        "inputs": {path: list(stat) if stat else None for path, stat in plan.inputs.items()},
        "footprints": {name: footprint.to_list() for name, footprint in plan.footprints.items()},
        "seams": [[seam.a, seam.b, seam.core] for seam in plan.seams],
        "model_input": plan.model_input.to_dict(),
        "scope": plan.scope,
        "predicted": plan.predicted,
        "unwatched": plan.unwatched,
        "neighbourhoods": None if plan.neighbourhoods is None else _neighbourhoods_json(plan.neighbourhoods),
    }
    return json.dumps(data, separators=(",", ":"))


def _neighbourhoods_json(neighbourhoods: Mapping[int, Neighbourhood]) -> list[Any]:
    return [[number, [*near.owners], [*near.neighbours], [*near.outer]] for number, near in neighbourhoods.items()]


# what reading a stored file that is not whole raises: the file system, its bytes as text (UnicodeDecodeError is a
# ValueError), json.loads, check_shape and the decoders (ValueError, KeyError, TypeError, IndexError, AttributeError)
UNREADABLE = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError)


class OtherFormat(ValueError):
    """A stored file of another format (another version of rasterscale wrote it): not read, built again quietly."""


# The shape of a stored plan's JSON as plan_to_json writes it (rasterscale.workflow.jsonshape's notation). What lies
# deeper (a kept scene's entry, a footprint, the model's bands) their own decoders check.
PLAN_SHAPE: dict[str, Any] = {
    "config": dict,
    "notices": [str],
    "origins": {str: str},
    "labels": [str],
    "untiled": {str: [str]},
    "geometry": {str: Row(str, int, int, int)},
    "members": [Row(int, [str])],
    "kept": [dict],
    "inputs": {str: (Row(int, int), None)},
    "footprints": {str: list},
    "seams": [Row(str, str, str)],
    "model_input": dict,
    "scope": (int, None),
    "predicted": (int, None),
    "unwatched": str,
    "neighbourhoods": ([Row(int, [str], [str], [str])], None),
}


def plan_from_json(text: str) -> Plan:
    """The plan of :func:`plan_to_json`'s JSON; an :class:`OtherFormat` when it is of another format, a ValueError
    (or KeyError, TypeError...) when it is no such JSON: cut short, or of another shape (:data:`PLAN_SHAPE`)."""
    data = json.loads(text)
    check_shape(data, dict, "the file")
    if data.get("format") != FORMAT:
        raise OtherFormat(f"stored plan of format {data.get('format')}, not {FORMAT}")
    check_shape(data, PLAN_SHAPE, "")
    return Plan(
        config=data["config"],
        notices=tuple(data["notices"]),
        origins=dict(data["origins"]),
        labels=tuple(data["labels"]),
        untiled={name: tuple(files) for name, files in data["untiled"].items()},
        geometry={s: Geometry(g[0], int(g[1]), int(g[2]), int(g[3])) for s, g in data["geometry"].items()},
        members={int(number): tuple(names) for number, names in data["members"]},
        kept={scene.name: scene for scene in (Scene.from_dict(entry) for entry in data["kept"])},
        inputs={path: (int(s[0]), int(s[1])) if s else None for path, s in data["inputs"].items()},
        footprints={name: Footprint.from_list(f) for name, f in data["footprints"].items()},
        seams=tuple(Seam(*seam) for seam in data["seams"]),
        model_input=InputBands.from_dict(data["model_input"]),
        scope=data["scope"],
        predicted=data["predicted"],
        unwatched=data["unwatched"],
        neighbourhoods=None
        if data["neighbourhoods"] is None
        else {int(n): Neighbourhood(tuple(a), tuple(b), tuple(c)) for n, a, b, c in data["neighbourhoods"]},
    )
