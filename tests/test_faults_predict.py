"""Faults of a prediction run and of snakemake itself, with real kill -9s (rasterscale.runtime.lifetime).

A local 2-rank prediction of the workflow (CPU ranks over gloo, an untrained RetinaNet at score threshold 0: plenty
of boxes) is killed mid-prediction, found by its processes (both ranks' dataloader workers have started, no rank record
is written yet): rank 0, then (after a plain rerun) rank 1, then snakemake itself. After each kill every process of
the job is gone within seconds, the run ends with an error, and every file at a final path opens. The recovery the
README gives (a plain rerun; after a killed snakemake `snakemake --unlock`, then `--rerun-incomplete`) ends with
the merged layer of an uninterrupted run, whose run also shows a second run started in its folder refused by
Snakemake's lock. On the loopback Slurm cluster, kill -9 of one rank of an srun-launched prediction ends the job.
And writers killed mid-write leave nothing at the final path. Every figure goes to the `evidence` summary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import rasterio
import torch

import snakemake_forks
from conftest import REPO, report, write_raster
from rasterscale.jobs.paths import RunPaths
from workflow import workflow_command

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 800, 600  # 48 tiles of 128 px: a few seconds of prediction per rank, after the marker
SCENE = "scene"
RUN = RunPaths("model")  # the run of model.file model.pt (no model.name: the file's stem): results/model/
MERGED = RUN.scene_file(SCENE, "detections.parquet")
LAYERS = (MERGED, RUN.scene_file(SCENE, "detections.gpkg"))  # what the uninterrupted run is asked for
JOB_ENDED_WITHIN_S = 30  # measured 1-4 s (snakemake notices the failed job; seconds more on a loaded machine)
PROCESSES_GONE_WITHIN_S = 20  # ranks and their dataloader workers: measured 0-1.2 s (die with their parent)
LOCK_MESSAGE = "Error: Directory cannot be locked."


def scene_config() -> dict:
    return {
        "scenes": {SCENE: {"path": "scene.tif"}},
        "tiling": {"patch_size": 128, "overlap": 32},
        "model": {"file": "model.pt", "backbone": "resnet18", "score_threshold": 0.0},
        "train": {"scenes": []},
        "predict": {"scenes": [SCENE], "devices": 2, "batch_size": 2, "workers": 1, "accelerator": "cpu"},
    }


def make_inputs(workdir: Path) -> None:
    """A random RGB raster and an untrained detector (the machinery is under test, not the model)."""
    from rasterscale.tasks.detection.model import DetectorConfig, build_detector, save_detector

    workdir.mkdir(parents=True, exist_ok=True)
    write_raster(workdir / "scene.tif", WIDTH, HEIGHT)
    torch.manual_seed(0)
    detector = DetectorConfig(backbone="resnet18", patch_size=128, score_threshold=0.0)
    save_detector(build_detector(detector), detector, workdir / "model.pt")


def start_workflow(workdir: Path, name: str, *args: str) -> subprocess.Popen:
    """snakemake on 2 cores in its own session (so that no signal of ours reaches it by accident); its output goes
    to ``{workdir}/{name}.out``."""
    command = workflow_command(workdir, scene_config(), "--cores", "2", *args)
    with (workdir / f"{name}.out").open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def output_of(workdir: Path, name: str) -> str:
    return (workdir / f"{name}.out").read_text()


def logs_of(workdir: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(workdir.glob("logs/**/*.log")))


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, float]:
    """snakemake's exit code, and the seconds it still ran."""
    started = time.monotonic()
    returncode = proc.wait(timeout)
    return returncode, time.monotonic() - started


def is_entry(process: psutil.Process, script: str = "predict.py") -> bool:
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    return len(command) > 1 and command[1].endswith(script)


def job_processes(root: int) -> dict[str, psutil.Process]:
    """The prediction processes under snakemake (pid ``root``) by role: rank0 (started by the rule's shell), rank1
    (forked by rank 0 once it has imported the engine, so before any dataloader worker: rank 0's first child), and
    the ranks' dataloader workers (their forked children)."""
    try:
        processes = [p for p in psutil.Process(root).children(recursive=True) if is_entry(p)]
    except psutil.NoSuchProcess:
        return {}
    pids = {p.pid for p in processes}
    roles: dict[str, psutil.Process] = {}
    try:
        for process in processes:
            if process.ppid() not in pids:
                roles["rank0"] = process
        if "rank0" in roles:
            children = sorted((p for p in roles["rank0"].children() if p.pid in pids), key=lambda p: p.create_time())
            roles.update({"rank1": children[0]} if children else {})
        for rank in [r for r in ("rank0", "rank1") if r in roles]:
            for child in roles[rank].children():
                if child.pid in pids and child.pid != roles.get("rank1", child).pid:
                    roles[f"{rank} worker"] = child
    except psutil.Error:
        return {}
    return roles


def wait_mid_prediction(proc: subprocess.Popen, workdir: Path, timeout: float = 240) -> dict[str, psutil.Process]:
    """Wait until both ranks predict (each rank's dataloader worker exists: its predict loop has started; the ranks
    start together, so either may be first) and return the job's processes; no rank record may exist yet (the kill
    then lands mid-prediction)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roles = job_processes(proc.pid)
        if {"rank0", "rank1", "rank0 worker", "rank1 worker"} <= set(roles):
            records = list(workdir.glob(f"{RUN.root}/predict/*/*/{SCENE}/rank-*.json"))
            assert not records, f"prediction ended before the marker was seen: {records}"
            return roles
        assert proc.poll() is None, f"snakemake ended ({proc.returncode}) before prediction:\n{logs_of(workdir)}"
        time.sleep(0.05)
    raise AssertionError(f"no prediction started within {timeout} s:\n{logs_of(workdir)}")


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(processes: dict[str, psutil.Process], since: float, timeout: float) -> dict[str, float]:
    """Seconds after ``since`` at which each process was gone (polled); the survivors are killed and reported."""
    ended: dict[str, float] = {}
    deadline = since + timeout
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for role, process in processes.items():
            if role not in ended and gone(process):
                ended[role] = time.monotonic() - since
        time.sleep(0.05)
    survivors = {role: p.pid for role, p in processes.items() if role not in ended}
    for process in processes.values():
        if not gone(process):
            process.kill()
    assert not survivors, f"still running {timeout} s after the kill: {survivors}"
    return ended


def final_files(workdir: Path) -> list[Path]:
    """Every file at a final path under results/ opens completely (temporaries of rasterscale.atomic.atomic_path,
    hidden siblings, are not final paths); returns them."""
    checked = []
    for path in sorted(p for p in (workdir / "results").rglob("*") if p.is_file() and not p.name.startswith(".")):
        if path.suffix == ".parquet":
            pq.read_table(path)
        elif path.suffix == ".gpkg":
            gpd.read_file(path)
        elif path.suffix == ".tif":
            with rasterio.open(path) as src:
                src.read()
        elif path.suffix == ".json":
            json.loads(path.read_text())
        checked.append(path.relative_to(workdir))
    return checked


def merged_rows(workdir: Path) -> np.ndarray:
    """The merged layer's rows (label, score, box), sorted: compared exactly between runs."""
    layer = gpd.read_parquet(workdir / MERGED)
    frame = layer.drop(columns="geometry")
    rows = frame.to_records(index=False)
    return np.sort(rows, order=list(frame.columns))


def copy_without_predictions(source: Path, workdir: Path) -> None:
    """A copy of a finished run (same inputs, manifest, job file and Snakemake metadata, mtimes kept) without its
    predictions and merged outputs: the rerun predicts and merges again."""
    shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("*.out", "log", "logs", "predict", "detections.*"))
    (workdir / RUN.scene_profile(SCENE)).unlink()


def wait_locked(proc: subprocess.Popen, workdir: Path, timeout: float = 120) -> None:
    """Wait until snakemake holds its lock on ``workdir`` (its lock files exist)."""
    deadline = time.monotonic() + timeout
    while not any((workdir / ".snakemake/locks").glob("*.lock")):
        assert proc.poll() is None and time.monotonic() < deadline, output_of(workdir, "first")[-2000:]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run; two more runs are started in its folder while it runs (both must be refused): one as
    soon as it holds its lock, one mid-prediction with `--rerun-incomplete` (without it Snakemake refuses that one
    for the incomplete shard folder of the running job, before it looks at the lock), while the job's processes
    are suspended (resumed once it is refused: the run then finishes as if uninterrupted)."""
    workdir = tmp_path_factory.mktemp("reference")
    make_inputs(workdir)
    started = time.monotonic()
    first = start_workflow(workdir, "first", *LAYERS)  # the layers alone: no scores or report pages to wait for
    wait_locked(first, workdir)
    refused = {"at its start": finish(start_workflow(workdir, "second"), timeout=120)}
    job = wait_mid_prediction(first, workdir)
    for process in job.values():  # the job holds still mid-prediction (its snakemake keeps the lock) while the
        process.suspend()  # third run starts and is checked: however slow its start, the first cannot finish first
    try:
        refused["mid-prediction"] = finish(start_workflow(workdir, "third", "--rerun-incomplete"), timeout=120)
    finally:
        for process in job.values():
            process.resume()
    code, _ = finish(first)
    assert code == 0, f"{output_of(workdir, 'first')[-3000:]}\n{logs_of(workdir)}"
    runs = "; ".join(f"{when}: exit {c} after {s:.1f} s" for when, (c, s) in refused.items())
    report(f"\n[faults] uninterrupted run: {time.monotonic() - started:.0f} s; runs started in its folder {runs}")
    outputs = {"at its start": output_of(workdir, "second"), "mid-prediction": output_of(workdir, "third")}
    return workdir, {when: (c, outputs[when]) for when, (c, _) in refused.items()}


@pytest.mark.parametrize("when", ["at its start", "mid-prediction"])
def test_a_second_run_in_the_same_folder_is_refused_by_the_lock(reference, when):
    workdir, refused = reference
    code, output = refused[when]
    assert code == 1
    assert LOCK_MESSAGE in output and "--unlock" in output, output[-2000:]
    files = final_files(workdir)  # the first run's outputs are complete
    assert Path(MERGED) in files and Path(RUN.scene_file(SCENE, "detections.gpkg")) in files
    assert len(merged_rows(workdir)) > 100


@dataclass(frozen=True)
class Fault:
    """What a kill -9 mid-prediction left: snakemake's exit code, seconds after the kill until snakemake and each
    process of the job had ended, the files at final paths (all complete), snakemake's output."""

    code: int
    ended_s: dict[str, float]
    files: list[Path]
    output: str
    rank_logs: str

    def summary(self, what: str) -> str:
        times = ", ".join(f"{role} {seconds:.1f} s" for role, seconds in sorted(self.ended_s.items()))
        return f"[faults] kill -9 of {what} mid-prediction: snakemake exit {self.code}; gone after the kill: {times}"


def kill_mid_prediction(workdir: Path, victim: str, *args: str) -> Fault:
    """Run the workflow, kill -9 ``victim`` (rank0, rank1 or snakemake) mid-prediction, wait until snakemake and every
    process of the job are gone."""
    proc = start_workflow(workdir, f"kill-{victim}", *args)
    roles = wait_mid_prediction(proc, workdir)
    roles["snakemake"] = psutil.Process(proc.pid)
    os.kill(roles.pop(victim).pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        ended = wait_gone(roles, killed, max(JOB_ENDED_WITHIN_S, PROCESSES_GONE_WITHIN_S))
    finally:
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
    logs = "".join(p.read_text() for p in sorted(workdir.glob("logs/predict/*/*/rank-*.log")))
    fault = Fault(code, ended, final_files(workdir), output_of(workdir, f"kill-{victim}"), logs)
    report(fault.summary(victim))
    return fault


@pytest.fixture(scope="module")
def faults(reference, tmp_path_factory):
    """One folder, faults one after the other, each recovered from as the README says: kill -9 of snakemake, then
    `--unlock` and a run with `--rerun-incomplete` in which rank 0 is killed, a plain rerun in which rank 1 is killed,
    and a plain rerun to the end."""
    workdir = tmp_path_factory.mktemp("faults") / "work"
    copy_without_predictions(reference[0], workdir)
    found = {"snakemake": kill_mid_prediction(workdir, "snakemake")}
    found["locks"] = sorted(p.name for p in (workdir / ".snakemake/locks").iterdir())
    found["incomplete"] = len(list((workdir / ".snakemake/incomplete").iterdir()))
    unlock = snakemake_forks.run(workflow_command(workdir, scene_config(), "--unlock"), timeout=120)
    assert unlock.returncode == 0, unlock.stderr
    found["rank0"] = kill_mid_prediction(workdir, "rank0", "--rerun-incomplete")
    found["rank1"] = kill_mid_prediction(workdir, "rank1")
    started = time.monotonic()
    code, _ = finish(start_workflow(workdir, "rerun"))
    assert code == 0, f"{output_of(workdir, 'rerun')[-3000:]}\n{logs_of(workdir)}"
    report(f"[faults] plain rerun after the last fault: {time.monotonic() - started:.0f} s")
    return workdir, found


def rank_processes_gone(fault: Fault) -> None:
    """Every rank and dataloader worker was gone within seconds of the kill."""
    job = {role: seconds for role, seconds in fault.ended_s.items() if role != "snakemake"}
    assert {"rank0", "rank1"} & set(job) and all(s < PROCESSES_GONE_WITHIN_S for s in job.values()), fault.ended_s


def test_killing_snakemake_ends_every_rank_within_seconds(faults):
    _, found = faults
    fault = found["snakemake"]
    assert fault.code == -signal.SIGKILL
    rank_processes_gone(fault)
    assert {"rank0", "rank1", "rank0 worker", "rank1 worker"} <= set(fault.ended_s)
    # the rank whose watchdog saw it first says why in its own log (rank 0 then kills rank 1 with its other children)
    noticed = [
        r for r in ("rank0", "rank1") if f"{r} ERROR rasterscale: the workflow process that started" in fault.rank_logs
    ]
    assert noticed and "is gone: ending this rank" in fault.rank_logs, fault.rank_logs[-2000:]
    # what the README's recovery commands are for: the lock and the incomplete marker of the killed run
    assert found["locks"] and found["incomplete"] == 1


@pytest.mark.parametrize("rank", ["rank0", "rank1"])
def test_killing_a_rank_ends_the_job_and_leaves_no_rank_and_no_shard_folder(faults, rank):
    _, found = faults
    fault = found[rank]
    assert fault.code == 1
    assert fault.ended_s["snakemake"] < JOB_ENDED_WITHIN_S
    rank_processes_gone(fault)
    assert "Error in rule predict" in fault.output
    # Snakemake removed the failed job's folder and no orphaned rank wrote into it afterwards
    assert not any(Path(f).parts[:3] == ("results", "model", "predict") for f in fault.files), fault.files
    assert Path(RUN.scene_manifest(SCENE)) in fault.files


def test_the_recovered_run_gives_the_uninterrupted_layer(reference, faults):
    workdir, _ = faults
    expected, got = merged_rows(reference[0]), merged_rows(workdir)
    report(f"[faults] merged layer after the faults: {len(got)} rows; uninterrupted: {len(expected)} rows")
    assert len(expected) > 100
    assert np.array_equal(got, expected)
    assert Path(RUN.scene_file(SCENE, "detections.gpkg")) in final_files(workdir)


def predict_command(config: dict) -> str:
    """The rule predict's command for one shard of 2 ranks launched by srun (what the Slurm profile runs): the
    batch's prediction job file, written by the plan of ``config``'s run."""
    from rasterscale.config.schema import validate_config
    from rasterscale.runtime.cores import planned_workers
    from rasterscale.runtime.preflight import srun_prefix

    workers = planned_workers(validate_config(config)["predict"].get("workers"))
    return (
        f"{srun_prefix(1, 2, workers + 1)}{sys.executable} {REPO / 'scripts/predict.py'}"
        f" --job {RUN.job_file('predict', 0)} --out-dir {RUN.shard_dir(0, 0)}"
        " --log-dir logs/predict/batch-0/shard-0 --shard 0"
    )


def slurm_job_processes(job_id: str) -> dict[str, psutil.Process]:
    """The prediction processes of a Slurm job on this host: rank{SLURM_PROCID} and their dataloader workers."""
    processes = {}
    for process in psutil.process_iter():
        try:
            if is_entry(process) and process.environ().get("SLURM_JOB_ID") == job_id:
                processes[process.pid] = process
        except psutil.Error:
            continue
    roles = {}
    for process in processes.values():
        try:
            if process.ppid() not in processes:
                rank = f"rank{process.environ()['SLURM_PROCID']}"
                roles[rank] = process
                roles.update({f"{rank} worker": child for child in process.children() if child.pid in processes})
        except psutil.Error:
            continue
    return roles


@pytest.mark.slurm
def test_on_slurm_killing_one_rank_ends_the_job_at_once(cluster, reference, tmp_path):
    """kill -9 of rank 0 of an srun-launched 2-rank prediction mid-prediction: srun's --kill-on-bad-exit ends rank 1
    (else blocked in a collective for gloo's 30 minutes) and the job."""
    run = tmp_path / "run"
    for name in ("scene.tif", "model.pt", RUN.scene_manifest(SCENE), RUN.job_file("predict", 0)):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(reference[0] / name, run / name)
    (run / "job.sh").write_text(f"#!/bin/sh\n{predict_command(scene_config())}\n")
    proc = cluster.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=2", "--output=job.out", "job.sh"],
        cwd=run,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while "rank1 worker" not in (roles := slurm_job_processes(job_id)) or "rank0" not in roles:
        assert time.monotonic() < deadline and cluster.job_state(job_id) in ("PENDING", "RUNNING", ""), (
            f"{cluster.job_state(job_id)}\n{(run / 'job.out').read_text() if (run / 'job.out').exists() else ''}"
        )
        time.sleep(0.1)
    assert not list(run.glob(f"{RUN.root}/predict/*/*/*/rank-*.json")), "prediction ended before the kill"
    os.kill(roles.pop("rank0").pid, signal.SIGKILL)
    killed = time.monotonic()
    ended = wait_gone(roles, killed, PROCESSES_GONE_WITHIN_S)
    state = cluster.wait_job(job_id, timeout=JOB_ENDED_WITHIN_S)
    job_s = time.monotonic() - killed
    times = ", ".join(f"{role} {seconds:.1f} s" for role, seconds in sorted(ended.items()))
    report(f"[faults] Slurm job {job_id}: kill -9 of rank 0 mid-prediction: job {state} after {job_s:.1f} s; {times}")
    assert state == "FAILED"
    assert "rank1" in ended
    output = (run / "job.out").read_text()
    assert "Killed" in output or "error" in output.lower(), output


WRITERS = {
    "atomic_path": (
        "out.bin",
        "from rasterscale.atomic import atomic_path\n"
        "with atomic_path(final) as tmp, open(tmp, 'wb') as f:\n"
        "    while True:\n"
        "        f.write(b'x' * 2**20)\n",
    ),
    "GeoPackage (merge)": (
        "detections.gpkg",
        "import numpy as np, geopandas as gpd, shapely\n"
        "from rasterscale.atomic import write_gpkg\n"
        "x = np.random.default_rng(0).uniform(0, 1000, 300_000)\n"
        "frame = gpd.GeoDataFrame({'score': x}, geometry=shapely.box(x, x, x + 1, x + 1), crs='EPSG:32617')\n"
        "write_gpkg(frame, final, layer='detections')\n",
    ),
    "COG (segmentation merge)": (
        "classes.tif",
        "from conftest import write_raster\n"
        "from rasterscale.raster.cog import convert_to_cog\n"
        "convert_to_cog(write_raster(final.parent / 'source.tif', 6000, 6000), final)\n",
    ),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_writer_killed_mid_write_leaves_nothing_at_the_final_path(writer, tmp_path):
    name, code = WRITERS[writer]
    final = tmp_path / name
    script = f"import sys\nsys.path[:0] = {[str(REPO / 'scripts'), str(REPO / 'tests')]!r}\n"
    script += f"from pathlib import Path\nfinal = Path({str(final)!r})\n{code}"
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    tmp_pattern = f".{final.stem}.tmp-{proc.pid}{final.suffix}"
    deadline = time.monotonic() + 120
    while not ((tmp := tmp_path / tmp_pattern).exists() and tmp.stat().st_size > 0):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    size = tmp.stat().st_size if tmp.exists() else 0
    report(f"[faults] {writer} writer killed mid-write: {size / 2**20:.1f} MiB in its temporary, final path empty")
    assert not final.exists()
    assert size > 0  # the kill did land mid-write


PROBE = """
import logging, os, sys, threading, time
sys.path.insert(0, {scripts!r})
from rasterscale.runtime.lifetime import bind_rank
logging.basicConfig(level=logging.INFO, format="%(message)s")
bind_rank(False, logging.getLogger("probe"), sigterm_ends=True)
{after}
print("bound", flush=True)
time.sleep(120)
"""


def start_probe(after: str = "", **env: str) -> subprocess.Popen:
    """A process that binds its life as a rank does (rasterscale.runtime.lifetime.bind_rank), then sleeps; ``env``: the
    variables it is started with."""
    script = PROBE.format(scripts=str(REPO / "scripts"), after=after)
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | env
    )


def wait_bound(probe: subprocess.Popen) -> None:
    assert probe.stdout is not None and probe.stdout.readline() == "bound\n", probe.communicate()


def process_id(pid: int) -> str:
    from rasterscale.runtime.lifetime import ProcessId, process_start

    return str(ProcessId(socket.gethostname(), pid, process_start(pid) or 0))


def test_a_rank_ends_once_the_workflow_process_is_gone():
    from rasterscale.runtime.lifetime import JOB_PARENT

    snakemake = subprocess.Popen(["sleep", "120"])  # stands for the snakemake process (not the probe's parent)
    probe = start_probe(**{JOB_PARENT: process_id(snakemake.pid)})
    wait_bound(probe)
    snakemake.kill()
    killed = time.monotonic()
    code = probe.wait(30)
    seconds = time.monotonic() - killed
    report(f"[lifetime] watched workflow process killed: the rank ended {code} after {seconds:.1f} s")
    assert code == 1 and seconds < 5
    assert f"the workflow process that started this job (pid {snakemake.pid} on " in probe.stderr.read()


def test_a_rank_ends_at_once_when_its_workflow_process_or_launcher_is_already_gone():
    from rasterscale.runtime.lifetime import JOB_PARENT, RANK_LAUNCHER

    sleeper = subprocess.Popen(["sleep", "120"])
    host, pid, start = process_id(sleeper.pid).split(":")
    reused = f"{host}:{pid}:{int(start) + 1}"  # the pid now runs another process: the original is gone
    other_host = f"elsewhere-{host}:{pid}:{int(start) + 1}"  # not watched: another host's process
    try:
        for env, message in [
            ({JOB_PARENT: reused}, f"the workflow process that started this job (pid {pid} on {host}) is gone"),
            ({RANK_LAUNCHER: process_id(sleeper.pid)}, f"the rank that launched this one (pid {pid}) is gone"),
        ]:
            probe = start_probe(**env)
            out, err = probe.communicate(timeout=30)
            assert probe.returncode == 1 and "bound" not in out and message in err, (env, out, err)
        probe = start_probe(**{JOB_PARENT: other_host})
        wait_bound(probe)
        probe.kill()
        probe.wait()
    finally:
        sleeper.kill()
        sleeper.wait()


LAUNCHER = """
import subprocess, sys, time
probe = subprocess.Popen([sys.executable, "-c", {probe!r}], stdout=subprocess.PIPE, text=True)
assert probe.stdout.readline() == "bound\\n"
print(probe.pid, flush=True)
time.sleep(120)
"""


def test_a_rank_dies_with_its_parent():
    """What PR_SET_PDEATHSIG gives: a rank started by another (as Lightning starts rank 1) dies with it."""
    probe = PROBE.format(scripts=str(REPO / "scripts"), after="")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(probe=probe)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    rank = psutil.Process(int(launcher.stdout.readline()))
    launcher.kill()
    killed = time.monotonic()
    launcher.wait()
    ended = wait_gone({"rank": rank}, killed, 10)
    report(f"[lifetime] parent of a rank killed: the rank was gone after {ended['rank']:.2f} s")


WORKER_PROBE = """
import functools, os, sys, time
import numpy as np
from torch.utils.data import DataLoader
sys.path.insert(0, {scripts!r})
from rasterscale.runtime.lifetime import bind_worker
tiles = [np.zeros((400, 400, 3), np.uint8)] * 100  # 480 KB a tile: a batch is more than a pipe holds
init = functools.partial(bind_worker, rank_pid=os.getpid())
batches = iter(DataLoader(tiles, batch_size=2, num_workers=1, collate_fn=list, worker_init_fn=init))
next(batches)
print("predicting", flush=True)
time.sleep(120)
"""


def test_a_dataloader_worker_dies_with_its_rank():
    """A rank killed by -9 while its worker has batches queued for it: the worker is gone within seconds. Without
    rasterscale.runtime.lifetime.bind_worker it ran on for good (torch's own check ends its loop, then its exit blocks
    writing the queued batch to the dead rank)."""
    rank = subprocess.Popen(
        [sys.executable, "-c", WORKER_PROBE.format(scripts=str(REPO / "scripts"))], stdout=subprocess.PIPE, text=True
    )
    assert rank.stdout is not None and rank.stdout.readline() == "predicting\n", rank.communicate()
    (worker,) = psutil.Process(rank.pid).children()
    rank.kill()
    killed = time.monotonic()
    rank.wait()
    ended = wait_gone({"worker": worker}, killed, 10)
    report(f"[lifetime] rank with a worker killed: the worker was gone after {ended['worker']:.2f} s")


def test_sigterm_ends_a_rank_whose_main_thread_is_stuck_in_a_signal_handler():
    """What Lightning's SIGTERM handler does when a peer is dead: it blocks in a broadcast (here: forever)."""
    after = "import signal\nsignal.signal(signal.SIGTERM, lambda signum, frame: threading.Event().wait())"
    probe = start_probe(after)
    wait_bound(probe)
    probe.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = probe.wait(30)
    seconds = time.monotonic() - sent
    report(f"[lifetime] SIGTERM to a rank stuck in a blocking handler: it ended {code} after {seconds:.2f} s")
    assert code == 143 and seconds < 5
    assert "received SIGTERM: ending this rank" in probe.stderr.read()
