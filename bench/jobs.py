"""Running the real prediction and training jobs (scripts/predict.py and scripts/train.py, as the predict and
train rules run them) and timing them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rasterscale.config.schema import validate_config
from rasterscale.jobs.files import PredictJob, TrainJob
from rasterscale.jobs.paths import rank_stem
from rasterscale.jobs.rankfiles import read_profiles
from rasterscale.scene import Scene
from rasterscale.settings import job_settings
from rasterscale.tasks.detection.modelfiles import read_model_file

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "scripts" / "predict.py"
TRAIN_ENTRY = REPO / "scripts" / "train.py"
# rank 0's progress line (rasterscale.train.engine.RankZeroProgress), with its log time
# (rasterscale.runtime.ranks.LOG_FORMAT)
PROGRESS = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO step (\d+)/\d+ epoch \d+ loss \S+ lr \S+ [\d.]+ images/s",
    re.MULTILINE,
)
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


@dataclass(frozen=True)
class JobResult:
    wall_s: float  # the whole job, process start to exit (imports, rank launch, prediction, rank files)
    profiles: list[dict[str, Any]]  # each rank's profile, from its rank file

    @property
    def tiles(self) -> int:
        return sum(p["tiles"] for p in self.profiles)


def predict_config(
    predict: dict[str, Any], score_threshold: float = 0.3, tiling: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The task, model, tiling and predict sections a prediction job's file carries (defaults filled in; ``tiling``
    as the bench's manifests cut their tiles), CPU ranks unless ``predict`` says otherwise."""
    config = validate_config(
        {
            "model": {"score_threshold": score_threshold},
            "tiling": tiling or {},
            "predict": {"accelerator": "cpu", **predict},
        }
    )
    return {key: config[key] for key in ("task", "model", "tiling", "predict")}


def run_job(what: str, command: list[str], cores: Iterable[int] | None, timeout: float) -> float:
    """Run a job's command (all its ranks), optionally bound to ``cores``; its wall time, process start to exit."""
    affinity = set(cores) if cores is not None else None

    def bind() -> None:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)

    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, preexec_fn=bind, cwd=REPO)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{what} job failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return wall


def run_predict_job(
    workdir: Path,
    raster: Path,
    manifest: Path,
    model_file: Path,
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
    world = config["predict"]["devices"]
    scene = Scene(
        "scene", str(raster), str(manifest), rank_files=tuple(rank_stem(out_dir, "scene", r) for r in range(world))
    )
    PredictJob(0, (scene,), str(model_file), 1, job_settings(config)).write(job)
    command = [sys.executable, str(ENTRY), "--job", str(job)]
    command += ["--out-dir", str(out_dir), "--log-dir", str(workdir / "logs")]
    wall = run_job("predict", command, cores, timeout)
    return JobResult(wall, read_profiles([rank_stem(out_dir, "scene", r) for r in range(world)]))


@dataclass(frozen=True)
class TrainResult:
    model: Path  # the trained model file
    wall_s: float  # the whole job, process start to exit (imports, rank launch, training, model files)
    meta: dict[str, Any]  # what rank 0 recorded in the model file: steps, seconds (of the fit), precision, ...
    progress: list[tuple[int, float]]  # rank 0's progress lines: (step, seconds since the first line)

    @property
    def steady_step_s(self) -> float:
        """Seconds per step from the first progress line to the last (the ranks' start and the first steps'
        warm-up come before the first)."""
        if len(self.progress) < 2:
            raise RuntimeError(
                f"training logged {len(self.progress)} progress line(s), a rate needs 2: raise max_steps or lower "
                "log_every_n_steps"
            )
        (first, start), (last, end) = self.progress[0], self.progress[-1]
        return (end - start) / (last - first)


def progress_lines(log: str) -> list[tuple[int, float]]:
    """(step, seconds since the first) of every progress line of rank 0's log."""
    lines = [(int(step), datetime.strptime(stamp, LOG_TIME)) for stamp, step in PROGRESS.findall(log)]
    return [(step, (when - lines[0][1]).total_seconds()) for step, when in lines]


def run_train_job(
    workdir: Path,
    scenes: list[dict[str, Any]],
    config: dict[str, Any],
    cores: Iterable[int] | None = None,
    timeout: float = 900,
) -> TrainResult:
    """One training job (all its ranks) of ``scenes`` (Scene fields) under ``config`` (a validated config's
    task, model, tiling and train sections), optionally bound to ``cores`` (a CPU rank takes its share of them);
    its wall time, the model file's metadata and rank 0's progress."""
    workdir.mkdir(parents=True, exist_ok=True)
    model, log_dir = workdir / "model.pt", workdir / "logs"
    job = workdir / "train-job.json"
    TrainJob(tuple(Scene.from_dict(scene) for scene in scenes), job_settings(config)).write(job)
    command = [
        sys.executable,
        str(TRAIN_ENTRY),
        *("--job", str(job), "--model", str(model)),
        *("--metrics", str(workdir / "metrics.csv"), "--plot", str(workdir / "curves.png"), "--log-dir", str(log_dir)),
    ]
    wall = run_job("train", command, cores, timeout)
    header, _ = read_model_file(model)
    return TrainResult(model, wall, dict(header.meta), progress_lines((log_dir / "rank-0.log").read_text()))
