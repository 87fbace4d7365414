"""Per-rank prediction profile: device memory per batch, device utilization, throughput and time waiting for data.

Like the seeds' mgpr summary, but every figure is measured over the whole run rather than sampled once:

- **time**: ``wall_s`` runs from the rank's setup (before its data are set up) to the end of its last batch and
  splits exactly into ``compute_s`` (inside ``predict_step``: the forward pass and the results back on the
  host, which waits for the device), ``output_s`` (the rank's outputs taking each batch's results: boxes
  gathered, class scores blended and blocks written, saved parts) and ``wait_s`` (everything else:
  reading tiles or a region, copies to the device, the loop itself), the time the device waited for data.
- **device memory**: on a GPU, the peak that torch allocated during each batch (the peak is reset at every
  batch start); on a CPU, where the device's memory is the host's, the rank's resident set after each batch.
  ``memory_peak_mb`` is the largest, ``memory_mean_mb`` the mean over batches. ``host_rss_peak_mb`` is the
  rank process's true peak resident set (the kernel's high-water mark, VmHWM), ``workers_rss_peak_mb`` the
  largest resident set seen of one of its dataloader workers (sampled at most once a second).
- **utilization**: on a GPU, NVML's busy fraction sampled every 0.2 s by a thread for the whole wall; on a CPU,
  the rank's CPU time over wall x its threads (OpenMP threads waiting at a barrier spin and count as busy).

The Lightning callback that measures is :class:`rasterscale.predict.measure.PredictProfiler`; this module holds what a
profile is, its probes, and how profiles are gathered and printed (without importing torch, so that the workflow
can print them). Each rank stores its profile in its rank record (:mod:`rasterscale.predict.rankfiles`); the merge
gathers a scene's into ``results/{run}/{scene}/predict_profile.json`` and prints them as one table.
"""

from __future__ import annotations

import multiprocessing
import resource
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from rasterscale.atomic import write_json
from rasterscale.predict.rankfiles import read_profiles

MB = 1024 * 1024
NVML_PERIOD_S = 0.2
WORKER_SAMPLE_PERIOD_S = 1.0


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


class UtilizationSampler:
    """NVML's GPU busy fraction sampled by a daemon thread until stopped; ``None`` when NVML is unavailable."""

    def __init__(self, device: Any, period: float = NVML_PERIOD_S) -> None:
        self.device, self.period = device, period
        self.samples: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        import torch

        while not self._stop.is_set():
            try:
                self.samples.append(torch.cuda.utilization(self.device) / 100.0)
            except Exception as err:  # no NVML library, driver or permission: report it, never fail the job
                self.error = f"{type(err).__name__}: {err}"
                return
            self._stop.wait(self.period)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=5)
        return sum(self.samples) / len(self.samples) if self.samples else None


def workers_rss() -> int:
    """Largest resident set of this process's dataloader workers (multiprocessing children), in bytes."""
    largest = 0
    for child in multiprocessing.active_children():
        try:
            largest = max(largest, psutil.Process(child.pid).memory_info().rss)
        except (psutil.Error, ValueError):
            continue
    return largest


def peak_rss() -> int:
    """This process's peak resident set in bytes: the kernel's high-water mark of this process image (VmHWM).

    getrusage's ru_maxrss is not used where VmHWM exists: it also counts the process this one was forked from
    before its exec (a rank started by a large parent would report the parent's size).
    """
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def rss_now() -> int:
    """This process's resident set now, in bytes."""
    return psutil.Process().memory_info().rss


def host_memory_total() -> int:
    return psutil.virtual_memory().total


def host_name() -> str:
    return socket.gethostname()


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
    }
    return {"ranks": ranks, "total": total}


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
    return "\n".join(lines)
