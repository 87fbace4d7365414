"""Faults of a training job, for real: a 2-rank DDP training (CPU ranks over gloo, the tiny config) killed with
kill -9 once a resume checkpoint exists, stopped by SIGTERM to every rank and to one rank, each rerun resuming
where the last one stopped (within epochs too), until the model is written: bit for bit the model of an
uninterrupted run (rasterscale.train.resume, rasterscale.datasets.sampling).

One chain of four runs of the train entry (what rule train runs), shared by the tests: the module fixture
runs it once; each test checks one fault. Every fault is a real signal (os.kill) at a point found by polling the
resume folder or the rank-0 log, never a blind sleep.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import snakemake_forks
from conftest import REPO, report
from rasterscale.atomic import write_json
from rasterscale.config.schema import validate_config
from rasterscale.jobs.files import TrainJob
from rasterscale.scene import Scene
from rasterscale.settings import Settings, job_settings, settings_of
from rasterscale.train.resume import (
    RESUME_FILE,
    STOP_EXIT_CODE,
    find_resume_point,
    training_fingerprint,
    training_resume_dir,
)
from workflow import run_paths, tiny_config, workflow_command

MAX_STEPS = 7  # the last SIGTERM (at step 5 or 6) leaves the last rerun a step or two
EVERY = 2  # checkpoint_every_n_steps
BATCH = 2  # an epoch of the tiny scene: 8 training tiles, 2 per step (1 per rank)
STEPS_PER_EPOCH = 4  # so that checkpoints and stops fall within epochs as well as at their ends
ENDS_WITHIN_S = 30  # a stopped or broken job must be gone by then (measured: a few seconds)
START_TIMEOUT_S = 240


@dataclass
class Run:
    """One training run of the chain: how it ended and what its rank-0 log said."""

    returncode: int | None
    seconds_to_end: float | None  # from the fault to the moment no rank was left
    log: str

    def resumed_at(self) -> int | None:
        match = re.search(r"resuming from (\S+) at step (\d+)", self.log)
        return int(match.group(2)) if match else None

    def stopped_at(self) -> int | None:
        match = re.search(r"stopped by SIGTERM at step (\d+); checkpoint (\S+); rerun to resume", self.log)
        return int(match.group(1)) if match else None


def train_command(workdir: Path) -> list[str]:
    """The train entry's command line, as rule train writes it, and its job file (the training scene, the
    task, model, tiling and train sections and the scene's entry)."""
    config = validate_config(
        tiny_config(
            train={
                "max_steps": MAX_STEPS,
                "epochs": 100,
                "batch_size": BATCH,
                "checkpoint_every_n_steps": EVERY,
                "val_every_n_epochs": 100,
            }
        )
    )
    sections = {key: config[key] for key in ("task", "model", "tiling", "train")}
    sections["scenes"] = {"tiny_train": config["scenes"]["tiny_train"]}  # the training scenes' entries
    scene = Scene(
        name="tiny_train",
        raster="resources/demo/tiny_train.tif",
        manifest=run_paths(config).scene_manifest("tiny_train"),  # results/tiny/: the tiny config's run
        annotations="resources/demo/tiny_train.gpkg",
        image_path="tiny_train.tif",
    )
    job = workdir / "train-job.json"
    TrainJob((scene,), job_settings(sections)).write(job)
    models = "results/models"
    return [
        sys.executable,
        str(REPO / "scripts/train.py"),
        *("--job", str(job), "--model", f"{models}/tiny.pt"),
        *("--metrics", f"{models}/tiny.metrics.csv", "--plot", f"{models}/tiny.png", "--log-dir", "logs/train/tiny"),
    ]


def rank_one(rank_zero: int) -> int:
    """Rank 1's pid: Lightning's launcher starts it as a child of rank 0 (the job's process)."""
    children = Path(f"/proc/{rank_zero}/task/{rank_zero}/children").read_text().split()
    return int(children[0])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"training ended ({process.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def run_training(workdir: Path, name: str, fault=None) -> Run:
    """Run the train entry; ``fault(process, log)`` (if any) waits for its moment, signals, and the run then
    must end (rank 0 and rank 1) within ENDS_WITHIN_S."""
    log = workdir / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(train_command(workdir), cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
        if fault is None:
            process.wait(timeout=START_TIMEOUT_S)
            return Run(process.returncode, None, log.read_text())
        pids = fault(process, log)
        signalled = time.monotonic()
        while (process.poll() is None or any(alive(pid) for pid in pids)) and (
            time.monotonic() - signalled < ENDS_WITHIN_S
        ):
            time.sleep(0.05)
        seconds = time.monotonic() - signalled
        for pid in [process.pid, *pids]:  # a hung run must not outlive its test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait()
    return Run(process.returncode, seconds, log.read_text())


def resume_index(workdir: Path) -> dict:
    path = training_resume_dir(workdir / "results/models/tiny.pt") / RESUME_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def kill_rank_one_after_checkpoint(workdir: Path):
    def fault(process: subprocess.Popen, log: Path) -> list[int]:
        wait_for(lambda: resume_index(workdir).get("step", 0) >= EVERY, "resume checkpoint", process, log)
        pid = rank_one(process.pid)
        os.kill(pid, signal.SIGKILL)
        return [pid]

    return fault


def sigterm_after_step(step: int, ranks: str):
    def fault(process: subprocess.Popen, log: Path) -> list[int]:
        wait_for(lambda: f"step {step}/{MAX_STEPS}" in log.read_text(), f"step {step}", process, log)
        pids = [process.pid, rank_one(process.pid)]
        for pid in pids if ranks == "all" else pids[1:]:
            os.kill(pid, signal.SIGTERM)
        return pids

    return fault


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Run]:
    """kill -9 of rank 1 → rerun, SIGTERM to both ranks → rerun, SIGTERM to rank 1 → rerun to the end."""
    workdir = tmp_path_factory.mktemp("train_faults")
    manifest = run_paths(tiny_config()).scene_manifest("tiny_train")
    command = workflow_command(workdir, tiny_config(), "--cores", "2", manifest)
    snakemake_forks.run(command, check=True, timeout=300)
    reference = workdir.parent / "uninterrupted"
    shutil.copytree(workdir, reference)
    runs = {"uninterrupted": run_training(reference, "uninterrupted")}
    runs["kill"] = run_training(workdir, "kill", kill_rank_one_after_checkpoint(workdir))
    after_kill = resume_index(workdir)["step"]
    runs["term_all"] = run_training(workdir, "term_all", sigterm_after_step(after_kill + 1, "all"))
    stopped = runs["term_all"].stopped_at() or after_kill
    runs["term_one"] = run_training(workdir, "term_one", sigterm_after_step(stopped + 1, "one"))
    runs["final"] = run_training(workdir, "final")
    runs["workdir"] = workdir  # type: ignore[assignment]
    return runs


def test_kill_9_of_a_rank_ends_the_job_and_the_rerun_resumes(chain):
    killed, rerun = chain["kill"], chain["term_all"]
    report(f"train kill -9 rank 1: job ended in {killed.seconds_to_end:.1f} s (exit {killed.returncode})")
    assert killed.returncode != 0 and killed.seconds_to_end < ENDS_WITHIN_S
    assert rerun.resumed_at() is not None and rerun.resumed_at() >= EVERY, rerun.log[-2000:]


@pytest.mark.parametrize("run, resumed_by", [("term_all", "term_one"), ("term_one", "final")])
def test_sigterm_checkpoints_stops_and_the_rerun_resumes_there(chain, run, resumed_by):
    stopped, rerun = chain[run], chain[resumed_by]
    step = stopped.stopped_at()
    report(
        f"train SIGTERM ({'both ranks' if run == 'term_all' else 'rank 1'}): stopped at step {step}, exit "
        f"{stopped.returncode}, job ended in {stopped.seconds_to_end:.1f} s; rerun resumed at {rerun.resumed_at()}"
    )
    assert stopped.returncode == STOP_EXIT_CODE and stopped.seconds_to_end < ENDS_WITHIN_S, stopped.log[-2000:]
    assert step is not None and step > (stopped.resumed_at() or 0)
    assert rerun.resumed_at() == step, rerun.log[-2000:]


def test_the_last_rerun_reaches_max_steps_and_writes_the_model(chain):
    final, workdir = chain["final"], chain["workdir"]
    assert final.returncode == 0, final.log[-3000:]
    assert f"trained {MAX_STEPS} steps" in final.log
    model = torch.load(workdir / "results/models/tiny.pt", map_location="cpu", weights_only=False)
    assert model["meta"]["steps"] == MAX_STEPS
    assert not training_resume_dir(workdir / "results/models/tiny.pt").exists()
    # the curves of all four runs, one training row per step: none lost, none doubled
    with open(workdir / "results/models/tiny.metrics.csv") as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row["train_loss"]]
    assert steps == list(range(MAX_STEPS))


def test_the_resumed_runs_train_the_model_of_the_uninterrupted_run(chain):
    """Four runs, resumed within epochs, train the very model of one uninterrupted run: each resumed epoch takes
    the rest of its samples, flipped as they would have been."""
    workdir, reference = chain["workdir"], chain["uninterrupted"]
    assert reference.returncode == 0, reference.log[-3000:]
    stops = [chain[run].stopped_at() for run in ("term_all", "term_one")]
    assert any(step % STEPS_PER_EPOCH for step in stops if step is not None), stops  # a stop within an epoch
    resumed = torch.load(workdir / "results/models/tiny.pt", map_location="cpu", weights_only=False)["state_dict"]
    uninterrupted = workdir.parent / "uninterrupted/results/models/tiny.pt"
    expected = torch.load(uninterrupted, map_location="cpu", weights_only=False)["state_dict"]
    assert resumed.keys() == expected.keys()
    differences = {key: float((resumed[key].double() - expected[key].double()).abs().max()) for key in expected}
    report(f"train resumed at steps {stops} vs uninterrupted: max abs weight difference {max(differences.values())}")
    worst = max(differences.items(), key=lambda item: item[1])
    assert all(torch.equal(resumed[key], expected[key]) for key in expected), worst


def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path):
    config = validate_config(tiny_config())
    scenes = [Scene("a", "a.tif", "a.parquet", annotations="a.gpkg")]

    def trained_with(**train: object) -> Settings:
        return settings_of({**config, "train": {**config["train"], **train}})

    run = training_fingerprint(settings_of(config), scenes, 2)
    assert training_fingerprint(trained_with(log_every_n_steps=7), scenes, 2) == run
    assert training_fingerprint(trained_with(lr=0.5), scenes, 2) != run
    assert training_fingerprint(settings_of(config), scenes, 4) != run
    assert find_resume_point(tmp_path, run).why == f"no resume checkpoint in {tmp_path}: training from step 0"
    write_json({"fingerprint": run, "step": 4, "checkpoint": "step-0000004.ckpt"}, tmp_path / RESUME_FILE)
    assert "is missing: starting over at step 0" in find_resume_point(tmp_path, run).why
    (tmp_path / "step-0000004.ckpt").write_bytes(b"written by a run")
    point = find_resume_point(tmp_path, run)
    assert (point.checkpoint, point.step) == (tmp_path / "step-0000004.ckpt", 4)
    other = find_resume_point(tmp_path, training_fingerprint(settings_of(config), scenes, 4))
    assert other.checkpoint is None and "written by another run" in other.why and "starting over" in other.why
