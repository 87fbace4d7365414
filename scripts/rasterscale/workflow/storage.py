"""The stored plan: a plan is stored as JSON under ``.snakemake/rasterscale/plan-{fingerprint}.json``
(:func:`store_plan`), the fingerprint a hash of the raw config; with it the files its checks read, by size and
mtime. The main Snakemake process stores it when it builds it (:mod:`rasterscale.workflow.reuse`: it reuses it
while nothing it read changed); a job's re-parse (cluster or subprocess) loads it (:func:`load_plan`) instead of
reading every header again, and builds it itself when none is stored for its config or an input changed since
(:func:`job_plan`).

Beside it, each batch's plan (:func:`batch_plan`, ``plan-{fingerprint}/batch-{b}.json``): what the jobs of one
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
from rasterscale.config.settings import config_of_scenes
from rasterscale.grid.partitions import Neighbourhood
from rasterscale.grid.project import Footprint, Seam, is_seam, seam_scenes
from rasterscale.jobs import paths
from rasterscale.raster.bands import InputBands
from rasterscale.runtime.preflight import Geometry
from rasterscale.scene import Scene
from rasterscale.workflow import partitions
from rasterscale.workflow.batches import job_batch
from rasterscale.workflow.checks import build_plan, file_stat, run_files, scene_files
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
        text = plan_to_json(batch_plan(plan, number))
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


def batch_plan(plan: Plan, batch: int) -> Plan:
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
    files = [*run_files(plan.settings), *(f for name in own for f in scene_files(plan.scenes[name]))]
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
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        damaged(path, "stored plan", err, warn)
        return None
    try:
        plan = plan_from_json(text)
        plan.paths  # noqa: B018  (its config typed, its run named: one of another shape fails here, not in a rule)
    except OtherFormat:
        return None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        damaged(path, "stored plan", err, warn)
        return None
    return plan


def damaged(path: Path, what: str, err: BaseException, warn: Warn | None) -> None:
    """A file of the stored plan that cannot be read: removed, with one warning line naming it and why."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
    reason = (str(err).splitlines() or [type(err).__name__])[0] or type(err).__name__
    (warn or _warn_on_stderr)(f"{path}: the {what} cannot be read ({type(err).__name__}: {reason}); it is built again")
    return None


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


class OtherFormat(ValueError):
    """A stored file of another format (another version of rasterscale wrote it): not read, built again quietly."""


class Row(tuple):
    """A JSON list of fixed length whose members have each its own shape (:func:`check_shape`)."""

    def __new__(cls, *shapes: Any) -> Row:
        return super().__new__(cls, shapes)


# The shape of a stored plan's JSON as plan_to_json writes it (check_shape's notation: a type; None for null; a tuple
# of alternatives; [shape] a list of them; {str: shape} an object of them; {"key": shape, ...} an object with these
# keys; Row(shape, ...) a list of these, in order). What lies deeper (a kept scene's entry, a footprint, the model's
# bands) their own decoders check.
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
_KINDS = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def check_shape(value: Any, shape: Any, where: str) -> None:
    """A ValueError naming the first part of ``value`` (JSON, as json.loads gives it) that is not of ``shape`` (the
    notation of :data:`PLAN_SHAPE`; a bool is no integer): a stored file of valid JSON but another shape (another
    file copied over it, one edited by hand) is damaged, never read as a plan. A whole plan of 200,000 scenes is
    checked in a fraction of its json.loads (a predicate made once per shape); the reason is looked for only when
    it fails."""
    if not _predicate(shape)(value):
        _find_misshapen(value, shape, where or "the file")
        raise ValueError(f"{where or 'the file'} is not of its shape")  # not reached: _find_misshapen raises


_PREDICATES: dict[int, tuple[Any, Callable[[Any], bool]]] = {}  # id(shape) -> (the shape, kept alive; its predicate)


def _predicate(shape: Any) -> Callable[[Any], bool]:
    """Whether a JSON value is of ``shape`` (exact types: json.loads makes no subclasses, and a bool is no int); the
    common members (strings, integers) tested in C (map over type), not a Python call each."""
    if id(shape) not in _PREDICATES:
        _PREDICATES[id(shape)] = (shape, _made_predicate(shape))
    return _PREDICATES[id(shape)][1]


def _made_predicate(shape: Any) -> Callable[[Any], bool]:
    if isinstance(shape, Row):
        if all(isinstance(part, type) for part in shape):  # [int, int]
            types = list(shape)
            return lambda v: type(v) is list and list(map(type, v)) == types
        parts = [_predicate(part) for part in shape]
        return lambda v: type(v) is list and len(v) == len(parts) and all(p(m) for p, m in zip(parts, v, strict=False))
    if isinstance(shape, tuple):
        alternatives = [_predicate(part) for part in shape if part is not None]
        nullable = None in shape
        if len(alternatives) == 1:  # a value or null: one call, not a generator's
            only = alternatives[0]
            return (lambda v: v is None or only(v)) if nullable else only
        return lambda v: (nullable and v is None) or any(p(v) for p in alternatives)
    if isinstance(shape, list) or (isinstance(shape, dict) and list(shape) == [str]):
        listed = isinstance(shape, list)
        inner = shape[0] if isinstance(shape, list) else shape[str]

        def members(value: Any) -> Any:
            return value if listed else value.values()

        container = list if listed else dict
        if isinstance(inner, type):  # [str], {str: str}
            return lambda v: type(v) is container and set(map(type, members(v))) <= {inner}
        each = _predicate(inner)
        return lambda v: type(v) is container and all(map(each, members(v)))
    if isinstance(shape, dict):
        keyed = [(key, _predicate(part)) for key, part in shape.items()]
        return lambda v: type(v) is dict and all(key in v and p(v[key]) for key, p in keyed)
    if shape is None:
        return lambda v: v is None
    return lambda v: type(v) is shape


def _find_misshapen(value: Any, shape: Any, where: str) -> None:
    """Raise the ValueError naming the first part of ``value`` not of ``shape`` (:func:`check_shape`'s reason)."""
    if isinstance(shape, Row):
        if not isinstance(value, list) or len(value) != len(shape):
            raise ValueError(f"{where} is {_kind(value)}, not a list of {len(shape)}")
        for index, (member, part) in enumerate(zip(value, shape, strict=True)):
            _find_misshapen(member, part, f"{where}[{index}]")
    elif isinstance(shape, tuple):
        others = [part for part in shape if part is not None]
        if value is not None and len(others) == 1 and not isinstance(others[0], type):  # a list or null: its reason
            _find_misshapen(value, others[0], where)
        elif not any(_predicate(part)(value) for part in shape):
            raise ValueError(f"{where} is {_kind(value)}, not {' or '.join(_described(part) for part in shape)}")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise ValueError(f"{where} is {_kind(value)}, not a list")
        for index, member in enumerate(value):
            _find_misshapen(member, shape[0], f"{where}[{index}]")
    elif isinstance(shape, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where} is {_kind(value)}, not an object")
        if list(shape) == [str]:
            for key, member in value.items():
                _find_misshapen(member, shape[str], f"{where}[{key!r}]")
            return
        for key, part in shape.items():
            if key not in value:
                raise ValueError(f"{where} has no key {key!r}")
            _find_misshapen(value[key], part, repr(key) if where == "the file" else f"{where}[{key!r}]")
    elif shape is None:
        if value is not None:
            raise ValueError(f"{where} is {_kind(value)}, not null")
    elif type(value) is not shape:
        raise ValueError(f"{where} is {_kind(value)}, not {_described(shape)}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in reversed(_KINDS.items()) if isinstance(value, kind)), type(value).__name__)


def _described(shape: Any) -> str:
    if shape is None:
        return "null"
    if isinstance(shape, Row):
        return f"a list of {len(shape)}"
    if isinstance(shape, list):
        return "a list"
    if isinstance(shape, dict):
        return "an object"
    return _KINDS.get(shape, getattr(shape, "__name__", str(shape)))


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
