"""Snakemake commands of the tests, each a fork of one process that has imported Snakemake and the workflow's
package already (one such process per test worker).

The suite runs `python -m snakemake ...` a few hundred times (dry runs, local runs). Each would spend about two
seconds of CPU importing Snakemake, its plugins and the package before it parses anything: a large share of a dry
run. Here a helper process, started once per test worker, imports them, then for each command forks a child that
is the command: its own process (own pid, working directory, environment and file descriptors; stdout and stderr
to files), running Snakemake's own entry point (``snakemake.cli.main``) with the command's arguments, exactly as
``python -m snakemake`` does once its imports are done. Its jobs are processes of its own, as always, forked from
the worker's job zygote (tests/job_forks.py: the fork's ``sys.executable`` is the zygote's client) unless
``fork_jobs`` is False. What is shared is only what the imports made, in its pristine state: the helper runs
nothing else.

Only ``[sys.executable, "-m", "snakemake", ...]`` commands in the worker's own environment (no ``env`` given) go
through the helper (:func:`run`); any other command (another Python, an environment of the test's own, e.g. one
where the package is not on the path, a process the test signals) is a plain subprocess.
``RASTERSCALE_TEST_FORKS=0`` turns the helper off.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import job_forks

REPO = Path(__file__).resolve().parents[1]
ENTRY = str(Path(importlib.util.find_spec("snakemake").origin).with_name("__main__.py"))  # type: ignore[arg-type]
ENABLED = os.environ.get("RASTERSCALE_TEST_FORKS", "1") != "0" and sys.platform.startswith("linux")


def preload() -> None:
    """What every snakemake process of the workflow imports before it parses: Snakemake's CLI, its executor and
    storage plugins, and the package modules rules/common.smk imports (from this checkout, as it inserts them)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import snakemake.cli  # noqa: F401
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

    ExecutorPluginRegistry().plugins  # noqa: B018  (the registry imports every installed executor plugin once)
    import snakemake_executor_plugin_slurm  # noqa: F401

    import rasterscale.workflow.checks
    import rasterscale.workflow.estimate
    import rasterscale.workflow.jobfiles
    import rasterscale.workflow.reports
    import rasterscale.workflow.steps
    import rasterscale.workflow.storage  # noqa: F401

    sys.path.remove(str(REPO / "scripts"))


def child(request: dict) -> None:
    """In the fork: become the command and never return (its exit status is Snakemake's)."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request.get("python"):  # the jobs' python: tests/job_forks.py's client (rules/common.smk reads it)
            sys.executable = request["python"]
        sys.argv = [ENTRY, *request["argv"]]  # as python -m snakemake sets it
        sys.path[0] = request["cwd"]  # python -m puts its working directory first
        from snakemake.cli import main

        main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """The helper: preload, then one request a line on stdin; answer the child's pid, then its exit status."""
    preload()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not garble the replies
    for line in sys.stdin:
        request = json.loads(line)
        threads = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
        if threads:  # Python's own (native library pools, as numpy's, have fork handlers)
            replies.write(
                json.dumps({"error": f"the helper runs threads ({', '.join(threads)}): it cannot fork"}) + "\n"
            )
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


class Helper:
    """The test worker's side: the helper process and its pipes."""

    def __init__(self) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="job-zygote-")
        self.zygote = job_forks.Zygote(Path(self.folder.name)) if job_forks.ENABLED else None
        atexit.register(self.stop)
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=REPO,
        )

    def stop(self) -> None:
        if self.zygote is not None:
            self.zygote.stop()
        self.folder.cleanup()

    def reply(self, timeout: float | None) -> dict:
        assert self.process.stdout is not None
        if timeout is not None:
            ready, _, _ = select.select([self.process.stdout], [], [], max(timeout, 0))
            if not ready:
                raise TimeoutError
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the snakemake fork helper ended ({self.process.wait()})")
        return json.loads(line)

    def run(self, command: list[str], timeout: float | None, cwd: str, fork_jobs: bool) -> subprocess.CompletedProcess:
        assert self.process.stdin is not None
        with tempfile.TemporaryDirectory(prefix="snakemake-fork-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": command[3:], "cwd": cwd, "env": dict(os.environ)}
            if fork_jobs and self.zygote is not None and self.zygote.alive():  # jobs forked from the zygote
                request |= {"env": self.zygote.environment(), "python": str(self.zygote.client)}
            self.process.stdin.write(json.dumps(request | {"stdout": str(out), "stderr": str(err)}) + "\n")
            started = self.reply(None)
            if "error" in started:
                raise RuntimeError(started["error"])
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                ended = self.reply(None if deadline is None else deadline - time.monotonic())
            except TimeoutError:
                os.kill(started["pid"], signal.SIGKILL)  # as subprocess.run does on a timeout
                self.reply(None)
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(command, ended["returncode"], out.read_text(), err.read_text())


_helper: Helper | None = None


def helper() -> Helper:
    """The worker's helper, started at its first use (and again if it ended)."""
    global _helper
    if _helper is None or _helper.process.poll() is not None:
        _helper = Helper()
    return _helper


def job_zygote() -> job_forks.Zygote | None:
    """The worker's zygote (tests/job_forks.py), started with its helper; None where forks are off."""
    zygote = helper().zygote if ENABLED else None
    return zygote if zygote is not None and zygote.alive() else None


def run(
    command: list[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    check: bool = False,
    fork_jobs: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, ...)``, through the worker's helper where the
    command is this Python's ``-m snakemake`` in this environment. ``fork_jobs``: its jobs are forks of the worker's
    zygote (tests/job_forks.py); False where the same folder is run again by a plain command: the rules' commands
    name their Python, and another one reruns them."""
    if not ENABLED or command[:3] != [sys.executable, "-m", "snakemake"] or env is not None:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=check)
    result = helper().run(command, timeout, os.path.abspath(cwd or os.getcwd()), fork_jobs)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    serve()
