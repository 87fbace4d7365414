"""Prediction profile records: what a rank's profile holds (:class:`RankProfile`), how a scene's are gathered from
its rank records into ``results/{run}/{scene}/predict_profile.json`` and printed as one table. The figures'
meaning and how they are measured: :mod:`rasterscale.predict.profile`. No torch and no psutil here: the workflow
prints these tables at the end of a run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasterscale.atomic import write_json
from rasterscale.jobs.rankfiles import read_profiles

# the stages of a rank's timeline, its main thread's, in batch order (rasterscale.predict.measure.StageClock)
STAGES = ("wait", "h2d", "forward", "post", "d2h", "blend", "write")


@dataclass(frozen=True)
class RankProfile:
    rank: int  # the rank file's index (shard * world_size + rank)
    shard: int
    world_size: int
    host: str
    device: str
    strategy: str
    precision: str
    batch_size: int
    workers: int
    threads: int
    tiles: int
    batches: int
    wall_s: float
    compute_s: float
    output_s: float  # the rank's outputs taking the batches' results (blend, write, saved parts)
    wait_s: float  # waiting for data: wall_s - compute_s - output_s
    output_fraction: float
    wait_fraction: float
    batches_per_s: float
    tiles_per_s: float
    memory_kind: str  # "cuda_allocated" (per-batch peaks) or "host_rss" (after each batch)
    memory_peak_mb: float
    memory_mean_mb: float
    memory_total_mb: float
    utilization: float | None  # fraction of the wall the device was busy
    utilization_source: str  # "nvml", "cpu_time" or "unavailable"
    host_rss_peak_mb: float
    workers_rss_peak_mb: float
    # the stage timeline: seconds of the rank's main thread per stage (wait, h2d, forward, post, d2h, blend,
    # write; they add up to wall_s), and of the work beside it: read (the dataloader's, in its workers), writer (a
    # writer thread's), device_* (on a GPU, the device's own time of the stages it runs)
    stages: dict[str, float] = field(default_factory=dict)
    parallel: dict[str, float] = field(default_factory=dict)


def summarize(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A scene's (or a job's) profile: its ranks, by rank, and their totals."""
    ranks = sorted((dict(r) for r in ranks), key=lambda r: r["rank"])
    wall = sum(r["wall_s"] for r in ranks)
    total = {
        "ranks": len(ranks),
        "tiles": sum(r["tiles"] for r in ranks),
        "batches": sum(r["batches"] for r in ranks),
        "wall_s": max((r["wall_s"] for r in ranks), default=0.0),
        "tiles_per_s": round(sum(r["tiles_per_s"] for r in ranks), 4),
        "batches_per_s": round(sum(r["batches_per_s"] for r in ranks), 4),
        # rank records written before output_s was measured have none (their output is in their wait)
        "output_fraction": round(sum(r.get("output_s", 0.0) for r in ranks) / wall, 4) if wall > 0 else 0.0,
        "wait_fraction": round(sum(r["wait_s"] for r in ranks) / wall, 4) if wall > 0 else 0.0,
        "memory_peak_mb": max((r["memory_peak_mb"] for r in ranks), default=0.0),
        "host_rss_peak_mb": max((r["host_rss_peak_mb"] for r in ranks), default=0.0),
        # the ranks' stage timelines added up (records written before the timeline have none)
        "stages": added(r.get("stages", {}) for r in ranks),
        "parallel": added(r.get("parallel", {}) for r in ranks),
    }
    return {"ranks": ranks, "total": total}


def added(figures: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Seconds per key, added over the ranks."""
    total: dict[str, float] = {}
    for seconds in figures:
        for key, value in seconds.items():
            total[key] = round(total.get(key, 0.0) + value, 4)
    return total


def timeline_line(total: Mapping[str, Any]) -> str:
    """The ranks' stage timeline in one line: each stage's seconds and share of the ranks' walls, and the work
    beside it (reads in the workers, a writer thread, the device's own time on a GPU)."""
    stages, parallel = total.get("stages") or {}, total.get("parallel") or {}
    wall = sum(stages.values())
    if wall <= 0:
        return "stages: -"
    shares = ", ".join(
        f"{stage} {stages[stage]:.2f} s ({stages[stage] / wall:.0%})" for stage in STAGES if stage in stages
    )
    beside = ", ".join(f"{key} {seconds:.2f} s" for key, seconds in parallel.items())
    return f"stages: {shares}; beside them: {beside or '-'}"


def gather_profile(rank_stems: Sequence[str | Path]) -> dict[str, Any]:
    """The profiles of all of a scene's rank records (all shards), with totals."""

    return summarize(read_profiles(rank_stems))


def write_scene_profile(rank_stems: Sequence[str | Path], path: str | Path) -> dict[str, Any]:
    """Gather a scene's rank profiles into ``path`` (JSON, atomically); returns what was written."""

    profile = gather_profile(rank_stems)
    write_json(profile, path)
    return profile


TABLE_COLUMNS = [
    ("rank", "rank", "{}"),
    ("device", "device", "{}"),
    ("strategy", "strategy", "{}"),
    ("tiles", "tiles", "{}"),
    ("batches", "batches", "{}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("batches/s", "batches_per_s", "{:.2f}"),
    ("tiles/s", "tiles_per_s", "{:.2f}"),
    ("data wait", "wait_fraction", "{:.1%}"),
    ("output", "output_fraction", "{:.1%}"),
    ("util", "utilization", "{:.1%}"),
    ("mem peak MB", "memory_peak_mb", "{:.0f}"),
    ("mem mean MB", "memory_mean_mb", "{:.0f}"),
    ("rss peak MB", "host_rss_peak_mb", "{:.0f}"),
]


def table_cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
    """A profile row's value formatted for a table; '-' where it has none."""
    value = row.get(key)
    return "-" if value is None or value == "" else fmt.format(value)


def format_profile_table(profile: Mapping[str, Any], title: str = "predict profile") -> str:
    """One table: a line per rank, then the totals (tiles/s and batches/s add up; wall is the longest rank's)."""
    total = profile["total"]
    rows = [[table_cell(r, key, fmt) for _, key, fmt in TABLE_COLUMNS] for r in profile["ranks"]]
    totals = {**total, "rank": "all", "device": "", "strategy": ""}
    rows.append([table_cell(totals, key, fmt) for _, key, fmt in TABLE_COLUMNS])
    header = [name for name, _, _ in TABLE_COLUMNS]
    widths = [max(len(header[k]), *(len(row[k]) for row in rows)) for k in range(len(header))]
    kind = {r["memory_kind"] for r in profile["ranks"]}
    source = {r["utilization_source"] for r in profile["ranks"]}
    lines = [
        f"{title}: {total['ranks']} rank(s), {total['tiles']} tiles, {total['tiles_per_s']:.2f} tiles/s "
        f"(memory: {', '.join(sorted(kind)) or '-'}; utilization: {', '.join(sorted(source)) or '-'})",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(timeline_line(total))
    return "\n".join(lines)
