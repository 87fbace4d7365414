"""Running the real prediction job (scripts/predict.py, as the predict rule runs it) and timing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasterscale.config import validate_config
from rasterscale.rankfiles import rank_stem, read_profiles

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "scripts" / "predict.py"


@dataclass(frozen=True)
class JobResult:
    wall_s: float  # the whole job, process start to exit (imports, rank launch, prediction, rank files)
    profiles: list[dict[str, Any]]  # each rank's profile, from its rank file

    @property
    def tiles(self) -> int:
        return sum(p["tiles"] for p in self.profiles)


def predict_config(predict: dict[str, Any], score_threshold: float = 0.3) -> dict[str, Any]:
    """The task, model and predict sections of a validated config (defaults filled in), CPU ranks."""
    config = validate_config(
        {"model": {"score_threshold": score_threshold}, "predict": {"accelerator": "cpu", **predict}}
    )
    return {"task": config["task"], "model": config["model"], "predict": config["predict"]}


def run_predict_job(
    workdir: Path,
    raster: Path,
    manifest: Path,
    checkpoint: Path,
    predict: dict[str, Any],
    cores: Iterable[int] | None = None,
    timeout: float = 900,
    config: dict[str, Any] | None = None,
) -> JobResult:
    """One prediction job (all its ranks), optionally bound to ``cores``; its wall time and rank profiles.
    ``config``: the job's whole config (task, model, tiling, predict), instead of a detection's with ``predict``."""
    config = config or predict_config(predict)
    out_dir = workdir / "predict"
    job = workdir / "job.json"
    workdir.mkdir(parents=True, exist_ok=True)
    scene = {"name": "scene", "raster": str(raster), "manifest": str(manifest)}
    job.write_text(json.dumps({"scenes": [scene]}))
    command = [
        sys.executable,
        str(ENTRY),
        *("--job", str(job), "--checkpoint", str(checkpoint)),
        *("--config", json.dumps(config), "--out-dir", str(out_dir), "--log-dir", str(workdir / "logs")),
    ]
    affinity = set(cores) if cores is not None else None

    def bind() -> None:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)

    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, preexec_fn=bind, cwd=REPO)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"predict job failed ({result.returncode}):\n{result.stderr[-4000:]}")
    world = config["predict"]["devices"]
    return JobResult(wall, read_profiles([rank_stem(out_dir, "scene", r) for r in range(world)]))
