"""rasterscale.runtime.launch: a local job's process forks the other ranks once it has imported what they run, gives
each its place in the job, waits for them at its end, and ends the job with one line when one of them fails."""

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from rasterscale.runtime.launch import rank_environments, starts_local_ranks
from rasterscale.runtime.lifetime import RANK_LAUNCHER

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {scripts!r})
    from rasterscale.settings import job_settings
    from rasterscale.runtime import launch
    from rasterscale.runtime.launch import start_local_ranks
    out, fail_rank, devices = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fail_code, zero_stops_after, imports = int(sys.argv[4]), float(sys.argv[5]), sys.argv[6:]
    for module in imports:  # what an entry imports before it starts the ranks
        __import__(module)
    launch.STOP_GRACE_SECONDS = 3.0
    ranks = start_local_ranks(job_settings({{"predict": {{"devices": devices, "shards": 1}}}}), "predict")
    rank = int(os.environ["LOCAL_RANK"])
    names = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RASTERSCALE_RANK_LAUNCHER")
    place = {{name: os.environ.get(name) for name in names}}
    place.update(pid=os.getpid(), ppid=os.getppid(), torch="torch" in sys.modules, cpu_s=sum(os.times()[:2]))
    (out / f"rank-{{rank}}.json").write_text(json.dumps(place))
    if rank == fail_rank:
        sys.exit(fail_code)
    if rank == 0 and zero_stops_after >= 0:  # rank 0 stops on its own, as after an agreed stop
        time.sleep(zero_stops_after)
        os._exit(143)
    if fail_rank >= 0:
        time.sleep(60)
    ranks.finish()
    """
)


def run_ranks(
    tmp_path: Path,
    devices: int,
    fail_rank: int = -1,
    fail_code: int = 3,
    zero_stops_after: float = -1,
    imports: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run a job of ``devices`` local ranks, started once ``imports`` are imported; rank ``fail_rank`` exits with
    ``fail_code``; rank 0 exits with 143 after ``zero_stops_after`` seconds where that is not negative."""
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(scripts=str(SCRIPTS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("LOCAL_RANK", "RANK")}
    command = [sys.executable, str(script), str(tmp_path), str(fail_rank), str(devices), str(fail_code)]
    command += [str(zero_stops_after), *imports]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def test_only_a_local_job_of_several_ranks_starts_them_here():
    assert starts_local_ranks(2, 1, {})
    assert not starts_local_ranks(1, 1, {})  # one rank: nothing to start
    assert not starts_local_ranks(2, 1, {"LOCAL_RANK": "1"})  # a rank started by another
    assert not starts_local_ranks(2, 1, {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})  # srun's
    assert not starts_local_ranks(2, 1, {"SLURM_JOB_ID": "7"})  # in an allocation: the pre-flight check refuses it
    assert not starts_local_ranks(4, 2, {})  # several nodes: their ranks are started by srun


def test_each_rank_gets_its_place_and_the_started_ones_their_launcher():
    environments = rank_environments(3, {"PATH": "/bin"}, 29500, "host:1:2")
    assert [env["LOCAL_RANK"] for env in environments] == ["0", "1", "2"]
    assert {env["MASTER_PORT"] for env in environments} == {"29500"}
    assert {env["WORLD_SIZE"] for env in environments} == {"3"} and {env["PATH"] for env in environments} == {"/bin"}
    assert RANK_LAUNCHER not in environments[0]
    assert [env[RANK_LAUNCHER] for env in environments[1:]] == ["host:1:2", "host:1:2"]


def test_the_ranks_start_from_rank_zero_and_share_one_rendezvous(tmp_path):
    result = run_ranks(tmp_path, devices=3)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"rank-{k}.json").read_text()) for k in range(3)]
    zero = ranks[0]
    assert zero["LOCAL_RANK"] == "0" and zero["RASTERSCALE_RANK_LAUNCHER"] is None
    assert all(rank["ppid"] == zero["pid"] for rank in ranks[1:])  # rank 0 started them
    assert all(rank["RASTERSCALE_RANK_LAUNCHER"].split(":")[1] == str(zero["pid"]) for rank in ranks[1:])
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"], r["NODE_RANK"], r["WORLD_SIZE"]) for r in ranks}) == 1
    assert zero["WORLD_SIZE"] == "3" and not any(rank["torch"] for rank in ranks)


def test_a_rank_that_fails_ends_the_job_at_once_with_one_line(tmp_path):
    started = time.monotonic()
    result = run_ranks(tmp_path, devices=3, fail_rank=2)
    seconds = time.monotonic() - started
    assert result.returncode == 1 and seconds < 20  # the others sleep 60 s
    failed = json.loads((tmp_path / "rank-2.json").read_text())
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert lines == [
        f"rasterscale: local rank 2 (pid {failed['pid']}) exited with code 3: ending the job's other ranks"
    ]
    sleeper = json.loads((tmp_path / "rank-1.json").read_text())
    time.sleep(0.5)
    assert not psutil.pid_exists(sleeper["pid"]) or psutil.Process(sleeper["pid"]).status() == psutil.STATUS_ZOMBIE


def test_a_rank_stopped_on_sigterm_lets_rank_zero_stop_and_the_job_exits_143(tmp_path):
    """A training job stops on all its ranks at one step: rank 1 may exit (143) a moment before rank 0 does."""
    result = run_ranks(tmp_path, devices=2, fail_rank=1, fail_code=143, zero_stops_after=1.5)
    assert result.returncode == 143, result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]


def test_a_rank_stopped_on_sigterm_ends_the_job_with_143_when_rank_zero_does_not_stop(tmp_path):
    started = time.monotonic()
    result = run_ranks(tmp_path, devices=3, fail_rank=2, fail_code=143)
    seconds = time.monotonic() - started
    assert result.returncode == 143 and 3 < seconds < 20, (seconds, result.stderr)  # the grace: 3 s, sleepers: 60
    stopped = json.loads((tmp_path / "rank-2.json").read_text())
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert lines == [
        f"rasterscale: local rank 2 (pid {stopped['pid']}) stopped on SIGTERM and rank 0 did not: ending the job"
    ]


def test_the_ranks_are_forked_with_what_rank_zero_imported_and_import_nothing_again(tmp_path):
    """A node imports torch once: the ranks rank 0 starts begin with its modules loaded, having spent no CPU time
    of their own (a rank that imported torch itself spent seconds)."""
    result = run_ranks(tmp_path, devices=3, imports=("torch",))
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"rank-{k}.json").read_text()) for k in range(3)]
    assert all(rank["torch"] for rank in ranks)
    assert ranks[0]["cpu_s"] > 0.5, ranks[0]  # rank 0 imported torch
    assert all(rank["cpu_s"] < 0.2 for rank in ranks[1:]), ranks


ENTRIES = {  # each entry and the module of what its ranks run
    "predict.py": "rasterscale.predict.engine",
    "train.py": "rasterscale.train.engine",
    "check_environment.py": "rasterscale.tools.envcheck",
}


def test_each_entry_imports_what_its_ranks_run_before_it_starts_them():
    """What an entry runs before start_local_ranks (its module's imports) imports torch, Lightning and its engine,
    so that the ranks it forks import nothing again. (The entries loaded one after the other in one process: torch
    once.)"""
    code = (
        "import importlib.util, json, sys\n"
        f"for entry, engine in {ENTRIES!r}.items():\n"
        f"    spec = importlib.util.spec_from_file_location('entry', {str(SCRIPTS)!r} + '/' + entry)\n"
        "    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "    assert hasattr(module, 'start_local_ranks'), entry\n"
        "    print(json.dumps([entry, engine in sys.modules, 'torch' in sys.modules, 'lightning' in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert [json.loads(line) for line in out.splitlines()] == [[entry, True, True, True] for entry in ENTRIES]


def test_each_entry_lets_openmp_threads_wait_asleep_before_torch_loads():
    """Every entry imports rasterscale, which sets OMP_WAIT_POLICY=PASSIVE (rasterscale.runtime.cores), before
    torch, whose OpenMP reads it once when it loads; a policy the environment sets is kept."""
    code = (
        "import importlib.util, json, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('entry', {str(SCRIPTS)!r} + '/predict.py')\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['torch'] = None  # torch must not load before the policy is set: an import of it fails here\n"
        "try:\n"
        "    spec.loader.exec_module(module)\n"
        "except ImportError:\n"
        "    print(os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(SCRIPTS)
    run = functools.partial(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run(env=env).stdout.split() == ["PASSIVE"]
    assert run(env={**env, "OMP_WAIT_POLICY": "ACTIVE"}).stdout.split() == ["ACTIVE"]
