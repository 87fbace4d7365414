"""The test machinery's snakemake commands (tests/snakemake_forks.py): a command forked from the helper is the same
command as a plain ``python -m snakemake`` subprocess: its exit status, its output, its working directory, its
environment (the caller's at the call, not the helper's at its start) and its timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import snakemake_forks

# A Snakefile that says where and how it runs, then exits as its config says (config values are strings).
PROBE = """
import os, sys
print(f"probe cwd={os.getcwd()} env={os.environ.get('FORKS_PROBE')} argv={sys.argv[1:]} ppid={os.getppid()}")
sys.stderr.write(f"probe stderr of {config.get('name', '')}\\n")
if config.get("sleep"):
    import time
    time.sleep(float(config["sleep"]))
if config.get("exit"):
    sys.exit(int(config["exit"]))

rule all:
    output: "done.txt"
    shell: "echo done > {output}"
"""

pytestmark = pytest.mark.skipif(not snakemake_forks.ENABLED, reason="the fork helper is off (RASTERSCALE_TEST_FORKS=0)")


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "Snakefile").write_text(PROBE)
    return tmp_path


def command(*config: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--cores", "1", "--config", "name=probe", *config]


def plain(cmd: list[str], cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def probe_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("probe ")]


def without_ppid(lines: list[str]) -> list[str]:
    return [line.rsplit(" ppid=", 1)[0] for line in lines]


def test_a_forked_command_exits_prints_and_runs_where_a_plain_one_does(probe, monkeypatch):
    """Its exit status (3: the Snakefile's own), stdout and stderr, working directory, arguments and environment;
    its parent is the helper (the command went through it), a plain one's the test."""
    monkeypatch.setenv("FORKS_PROBE", "set-at-the-call")
    cmd = command("exit=3")
    forked = snakemake_forks.run(cmd, cwd=probe)
    reference = plain(cmd, probe)
    assert forked.returncode == reference.returncode == 3
    printed, expected = probe_lines(forked.stdout), probe_lines(reference.stdout)
    assert without_ppid(printed) == without_ppid(expected) == [f"probe cwd={probe} env=set-at-the-call argv={cmd[3:]}"]
    assert probe_lines(forked.stderr) == probe_lines(reference.stderr) == ["probe stderr of probe"]
    helper = snakemake_forks._helper
    assert helper is not None and printed[0].endswith(f" ppid={helper.process.pid}")  # it went through the helper
    assert expected[0].endswith(f" ppid={os.getpid()}")


def test_a_forked_commands_environment_is_the_callers_at_the_call_and_its_jobs_run(probe, monkeypatch):
    """The helper started before: a variable set, then removed, reaches the fork as it reaches a plain command
    (exit status 0 both); the fork's rule runs its job as Snakemake does, in the command's working directory."""
    monkeypatch.setenv("FORKS_PROBE", "first")
    snakemake_forks.run(command(), cwd=probe, check=True)
    assert (probe / "done.txt").read_text() == "done\n"
    monkeypatch.delenv("FORKS_PROBE")
    forked = snakemake_forks.run(command("exit=0"), cwd=probe)
    reference = plain(command("exit=0"), probe)
    assert forked.returncode == reference.returncode == 0
    assert without_ppid(probe_lines(forked.stdout)) == without_ppid(probe_lines(reference.stdout))
    assert "env=None" in probe_lines(forked.stdout)[0]


def test_a_forked_command_past_its_timeout_is_killed_as_a_plain_one(probe):
    cmd = command("sleep=60")
    for run in (lambda: snakemake_forks.run(cmd, cwd=probe, timeout=3), lambda: plain(cmd, probe, timeout=3)):
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            run()
        assert time.monotonic() - started < 30
    helper = snakemake_forks._helper
    assert helper is not None and helper.process.poll() is None  # the helper serves the next command
    assert snakemake_forks.run(command("exit=0"), cwd=probe).returncode == 0
