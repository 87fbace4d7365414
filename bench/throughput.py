"""What make bench and make bench-gpu record for the dry run's cost estimate: the throughput of the prediction job
each already measures (and make bench-gpu's training job), as one entry of results/throughput.json
(:mod:`rasterscale.workflow.throughput`; docs/performance.md, "Cost estimate"). Torch-free: the entries are made
from the benches' results.
"""

from __future__ import annotations

import datetime
import platform
from typing import Any

from rasterscale.workflow.throughput import CPU, GPU, Throughput


def now() -> str:
    """The date of an entry: now, UTC, ISO 8601."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def host() -> str:
    return platform.node() or "this machine"


def measured(run: Any) -> bool:
    """Whether a bench's run is a result (not missing, not its error)."""
    return isinstance(run, dict) and "error" not in run


def cpu_entry(result: dict[str, Any], patch_size: int, overlap: int, model: str, date: str = "") -> Throughput:
    """make bench's entry: its efficiency job, the real prediction job over ``patch_size`` px tiles at ``auto`` (one
    rank on all the cores; ``details.efficiency``): its ranks' tiles/s over their threads."""
    job, machine = result["details"]["efficiency"], result["machine"]
    ranks = job["ranks"]
    return Throughput(
        kind=CPU,
        device=machine["cpu"],
        tiles_per_s=round(sum(rank["tiles_per_s"] for rank in ranks), 4),
        devices=sum(rank["threads"] for rank in ranks),
        ranks=len(ranks),
        patch_size=patch_size,
        overlap=overlap,
        precision=", ".join(sorted({str(rank["precision"]) for rank in ranks})),
        model=model,
        date=date or now(),
        machine=f"{host()} ({machine['cores']} cores)",
        source="make bench",
    )


def gpu_entry(result: dict[str, Any], date: str = "") -> Throughput | None:
    """make bench-gpu's entry: its prediction job at ``auto`` (one rank per GPU), with its training job's images/s
    where that ran; None for a CPU run (its tiny sizes say nothing of a throughput) or where the job failed."""
    gpus = result["machine"].get("gpus") or []
    run = result["sections"].get("predict", {}).get("runs", {}).get("auto")
    if result["mode"] != "gpu" or not gpus or not measured(run):
        return None
    train = result["sections"].get("train", {}).get("runs", {}).get("auto")
    trained = measured(train)
    return Throughput(
        kind=GPU,
        device=gpus[0],
        tiles_per_s=run["tiles_per_s"],
        devices=len(run["ranks"]),
        ranks=len(run["ranks"]),
        patch_size=result["sizes"]["patch"],
        overlap=result["sizes"]["overlap"],
        precision=run["precision"],
        model=result["sections"]["predict"]["model"],
        date=date or now(),
        machine=f"{host()} ({len(gpus)} x {gpus[0]})",
        source="make bench-gpu",
        train_images_per_s=train["images_per_s"] if trained else None,
        train_devices=train["ranks"] if trained else 0,
    )
