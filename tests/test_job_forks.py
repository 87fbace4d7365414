"""The test machinery's job processes (tests/job_forks.py): a job forked from the zygote is what the same command run
by a plain interpreter is: the same output, exit status (a code, a message, an uncaught exception, a signal),
working directory, environment, arguments and ``sys.path[0]``; signals sent to it reach the job, and killing it
kills the job. Commands the zygote cannot be go to the real interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import job_forks

pytestmark = pytest.mark.skipif(not job_forks.ENABLED, reason="job forks are off (RASTERSCALE_TEST_JOB_FORKS=0)")

PROBE = """
import json, os, signal, sys, time
mode = sys.argv[1]
facts = {"argv": sys.argv, "cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "path0": sys.path[0],
         "name": __name__, "file": __file__}
print(json.dumps(facts))
print("to stderr", file=sys.stderr)
sys.stdout.flush()  # before a signal ends it (a pipe's output is buffered)
open(os.environ["PROBE_PID"], "w").write(f"{os.getpid()} {os.getppid()}")
if mode == "code":
    sys.exit(3)
if mode == "message":
    sys.exit("a message of its own")
if mode == "raise":
    raise ValueError("boom")
if mode == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "stdin":
    print(sys.stdin.read().upper())
if mode == "sleep":
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zygote")
    zygote = job_forks.Zygote(folder)
    yield zygote
    zygote.stop()


@pytest.fixture
def probe(tmp_path) -> Path:
    """The probe as a Snakemake ``script:``'s temporary script (one the zygote forks for)."""
    script = tmp_path / "work/.snakemake/scripts/tmpprobe.probe.py"
    script.parent.mkdir(parents=True)
    script.write_text(PROBE)
    return script


def run(python: str, probe: Path, mode: str, zygote, **kwargs) -> tuple[subprocess.CompletedProcess, list[int]]:
    pid_file = probe.parent / f"pid-{mode}-{Path(python).name}-{time.monotonic_ns()}"
    env = {**os.environ, "PROBE": "yes", "PROBE_PID": str(pid_file), job_forks.SOCKET_ENV: zygote.socket}
    result = subprocess.run(
        [python, str(probe), mode, "an argument"],
        cwd=probe.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )
    return result, [int(value) for value in pid_file.read_text().split()]


@pytest.mark.parametrize("mode", ["ok", "code", "message", "raise", "signal", "stdin"])
def test_a_forked_job_is_the_plain_interpreters_command(zygote, probe, mode):
    forked, (_, forked_parent) = run(str(zygote.client), probe, mode, zygote, input="some input")
    plain, (_, plain_parent) = run(sys.executable, probe, mode, zygote, input="some input")
    assert forked_parent == zygote.process.pid, "the job ran in a fork of the zygote"
    assert plain_parent == os.getpid()
    assert forked.returncode == plain.returncode == {"code": 3, "message": 1, "raise": 1, "signal": -15}.get(mode, 0)
    assert forked.stdout == plain.stdout
    facts = json.loads(forked.stdout.splitlines()[0])
    assert facts == {
        "argv": [str(probe), mode, "an argument"],
        "cwd": str(probe.parents[2]),
        "probe": "yes",
        "path0": str(probe.parent),
        "name": "__main__",
        "file": str(probe),
    }
    if mode == "raise":  # the same report; the fork's traceback also shows runpy's frames
        assert forked.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == "ValueError: boom"
        assert forked.stderr.startswith("to stderr\nTraceback (most recent call last):")
    else:
        assert forked.stderr == plain.stderr


def test_a_signal_to_the_client_reaches_the_job_and_a_killed_client_takes_the_job_with_it(zygote, probe):
    env = {**os.environ, "PROBE_PID": str(probe.parent / "pid"), job_forks.SOCKET_ENV: zygote.socket}
    for sent, code in ((signal.SIGTERM, -15), (signal.SIGKILL, -9)):
        (probe.parent / "pid").unlink(missing_ok=True)
        client = subprocess.Popen([str(zygote.client), str(probe), "sleep"], env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not (probe.parent / "pid").exists() or not (probe.parent / "pid").read_text():
            assert time.monotonic() < deadline and client.poll() is None
            time.sleep(0.05)
        job = int((probe.parent / "pid").read_text().split()[0])
        assert job != client.pid
        client.send_signal(sent)
        assert client.wait(timeout=10) == code
        deadline = time.monotonic() + 10
        while Path(f"/proc/{job}").exists() and "Z" not in Path(f"/proc/{job}/stat").read_text().split()[2]:
            assert time.monotonic() < deadline, f"the job outlived its client's {sent.name}"
            time.sleep(0.05)


def test_what_the_zygote_cannot_be_runs_in_the_real_interpreter(zygote, tmp_path):
    outside = tmp_path / "elsewhere.py"  # a script of neither this checkout nor a Snakemake script folder
    outside.write_text("import os; print(os.getppid())")
    env = {**os.environ, job_forks.SOCKET_ENV: zygote.socket}
    for command in ([str(zygote.client), str(outside)], [str(zygote.client), "-c", "import os; print(os.getppid())"]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
        assert int(result.stdout) == os.getpid(), command  # the client exec'd Python: its parent is this test
