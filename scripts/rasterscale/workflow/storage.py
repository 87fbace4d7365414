"""The stored plan: a plan is stored as JSON under ``.snakemake/rasterscale/plan-{fingerprint}.json``
(:func:`store_plan`), the fingerprint a hash of the raw config; with it the files its checks read, by size and
mtime. The main Snakemake process builds and stores it every invocation; a job's re-parse (cluster or subprocess)
loads it (:func:`load_plan`) instead of reading every header again, and builds it itself when none is stored for
its config or an input changed since (:func:`workflow_plan`). The main process's plan reads the scenes' headers
through the header cache (``.snakemake/rasterscale/headers.sqlite``, :mod:`rasterscale.raster.header_cache`), so
its next invocation reads only those of rasters that changed; a job's does not use it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rasterscale.atomic import atomic_path
from rasterscale.grid.project import Footprint, Seam
from rasterscale.jobs import paths
from rasterscale.jobs.files import PredictionBatch
from rasterscale.raster.bands import InputBands
from rasterscale.runtime.preflight import Geometry
from rasterscale.scene import Scene
from rasterscale.workflow.checks import build_plan, file_stat
from rasterscale.workflow.plan import Plan

FORMAT = 4  # of a stored plan: a plan stored in another format is rebuilt


def fingerprint(raw: Mapping[str, Any]) -> str:
    """The stored plan's key: a hash of the raw config (and the plan's format)."""
    text = json.dumps({"format": FORMAT, "config": raw}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


KEPT_PLANS = 8  # stored plans kept (the newest): one per config a working folder ran with lately


def store_plan(plan: Plan, key: str, workdir: str | Path = ".") -> Path:
    """Write the plan atomically under ``.snakemake/rasterscale/plan-{key}.json``, and remove all but the newest
    :data:`KEPT_PLANS` stored plans (a job that finds its plan gone builds it again); its path."""
    path = Path(workdir) / paths.stored_plan(key)
    with atomic_path(path) as tmp:
        tmp.write_text(plan_to_json(plan))
    stored = sorted(path.parent.glob("plan-*.json"), key=_mtime, reverse=True)
    for old in stored[KEPT_PLANS:]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def load_plan(key: str, workdir: str | Path = ".") -> Plan | None:
    """The plan stored under ``key``, or None when there is none, it is unreadable or of another format, or a
    file its checks read changed since (size or mtime; one absent then is the workflow's to make)."""
    path = Path(workdir) / paths.stored_plan(key)
    try:
        plan = plan_from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    base = Path(workdir)
    # a file absent when the plan was built is one the workflow makes (a demo scene): its appearing changes nothing
    if any(stat is not None and file_stat(base / name) != stat for name, stat in plan.inputs.items()):
        return None
    return plan


def workflow_plan(
    raw: Mapping[str, Any], main_process: bool, workdir: str | Path = ".", warn: Callable[[str], None] | None = None
) -> Plan:
    """The plan of this parse: the main process builds it with every check (its headers through the header cache
    of ``workdir``) and stores it; a job's re-parse loads the stored one, and builds it (without storing, nor using
    the header cache) when none is stored for its config or it is stale."""
    key = fingerprint(raw)
    if not main_process:
        stored = load_plan(key, workdir)
        if stored is not None:
            return stored
        return build_plan(raw, workdir, warn)  # no header cache: a job neither reads nor writes it
    plan = build_plan(raw, workdir, warn, cache_headers=True)
    store_plan(plan, key, workdir)
    return plan


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
        "batches": [[b.batch, [scene.to_dict() for scene in b.scenes]] for b in plan.batches],
        "inputs": {path: list(stat) if stat else None for path, stat in plan.inputs.items()},
        "footprints": {name: footprint.to_list() for name, footprint in plan.footprints.items()},
        "seams": [[seam.a, seam.b, seam.core] for seam in plan.seams],
        "model_input": plan.model_input.to_dict(),
    }
    return json.dumps(data, separators=(",", ":"))


def plan_from_json(text: str) -> Plan:
    """The plan of :func:`plan_to_json`'s JSON; a ValueError when it is of another format."""
    data = json.loads(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"stored plan of format {data.get('format')}, not {FORMAT}")
    return Plan(
        config=data["config"],
        notices=tuple(data["notices"]),
        origins=dict(data["origins"]),
        labels=tuple(data["labels"]),
        untiled={name: tuple(files) for name, files in data["untiled"].items()},
        geometry={s: Geometry(g[0], int(g[1]), int(g[2]), int(g[3])) for s, g in data["geometry"].items()},
        batches=tuple(
            PredictionBatch(int(number), tuple(Scene.from_dict(s) for s in scenes))
            for number, scenes in data["batches"]
        ),
        inputs={path: (int(s[0]), int(s[1])) if s else None for path, s in data["inputs"].items()},
        footprints={name: Footprint.from_list(f) for name, f in data["footprints"].items()},
        seams=tuple(Seam(*seam) for seam in data["seams"]),
        model_input=InputBands.from_dict(data["model_input"]),
    )
