"""A rank never outlives its job: every rank dies with the process that launched it.

Who launches a rank, and what ends it when that launcher is gone (:func:`bind_rank`, called by
``runtime.start_rank``, so every training, prediction and environment-check rank does it first):

- **Its parent process.** Every rank asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``): the
  rule's shell for the rank that Snakemake starts (and srun's slurmstepd for each srun task), the rank that
  started the others (:mod:`rasterscale.runtime.launch`) for them. So killing local rank 0 takes the ranks it
  started with it at once (before, rank 1 ran on, finished its tiles and wrote them into the shard folder Snakemake
  had already removed; once it stayed asleep in a collective for 45 minutes). A rank started by another rank also
  checks that this parent is still the one that started it (:data:`RANK_LAUNCHER`): it may have died while the new
  rank was still importing torch, before the death signal was asked for.
- **The Snakemake process running the job.** The rule's shell outlives a killed ``snakemake`` (it is reparented, not
  killed), so the parent check above never fires. The workflow exports its own process in :data:`JOB_PARENT` when
  it loads (``rules/common.smk``); a daemon thread of every rank on the same host polls it and, once it is gone
  (or was gone before the rank started), logs one line, kills the rank's own child processes (the ranks it started,
  its dataloader workers) and exits. On a Slurm cluster the process is the job's own ``snakemake`` (the executor
  runs one inside the job); ranks on other nodes rely on srun's ``--kill-on-bad-exit=1`` and Slurm's end of the job.

- **Its dataloader workers** (:func:`bind_worker`, the ``worker_init_fn`` of every prediction and training
  dataloader) die with their rank too. torch's own check (a worker ends its loop once its parent is gone, within
  5 s) is not enough: the worker then joins its queue's feeder thread at exit, and that thread blocks for good
  writing a batch of more than the pipe's 64 KB to a rank that no longer reads (a worker of a rank killed by -9
  ran on with its memory until the test killed it).

A peer that dies: locally rank 0 watches the ranks it started (:class:`rasterscale.runtime.launch.LocalRanks`) and kills
everything when one exited non-zero (and a rank blocked in a gloo collective gets a connection reset from its dead
peer); under srun, ``--kill-on-bad-exit=1`` ends the step: Slurm sends SIGTERM to the other ranks, and SIGKILL
KillWait later (30 s by default). Lightning's own SIGTERM handler only logs ("Bypassing SIGTERM") and a prediction
rank would predict on (or block in that handler's broadcast to the dead peer) until that SIGKILL, so a prediction
rank ends at SIGTERM (:func:`end_on_sigterm`; also at the time limit or an scancel: its finished work is in
atomically written files). Training's SIGTERM is left to the trainer (a checkpoint, then exit).

Processes are told apart by :class:`ProcessId` (host, pid, and the start time in /proc, so a reused pid is not
mistaken for the original). Linux only; elsewhere :func:`bind_rank` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

JOB_PARENT = "RASTERSCALE_JOB_PARENT"  # host:pid:start of the snakemake process that runs the rank's job
RANK_LAUNCHER = "RASTERSCALE_RANK_LAUNCHER"  # host:pid:start of the rank that starts the other local ranks
POLL_SECONDS = 1.0
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
EXIT_CODE = 1
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
_SIGTERM_THREAD: threading.Thread | None = None  # end_on_sigterm's, once per process


@dataclass(frozen=True)
class ProcessId:
    """One process on one host: its pid and its start time (clock ticks after boot, /proc/<pid>/stat field 22)."""

    host: str
    pid: int
    start: int

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.start}"

    @classmethod
    def parse(cls, text: str) -> ProcessId | None:
        """The process written by ``str()``; None for anything else (a value this module did not write)."""
        parts = text.rsplit(":", 2)
        if len(parts) != 3 or not parts[0] or not (parts[1].isdigit() and parts[2].isdigit()):
            return None
        return cls(parts[0], int(parts[1]), int(parts[2]))

    @property
    def here(self) -> bool:
        """On this host (only a process here can be watched)."""
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Still running: the pid exists, is not a zombie, and started when this process did."""
        return process_start(self.pid) == self.start


def process_start(pid: int) -> int | None:
    """The start time of a running process from /proc, None if there is none (or only its zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 (state) onwards
    return None if fields[0] in ("Z", "X", "x") else int(fields[19])


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def this_process() -> ProcessId:
    """This process as a :class:`ProcessId` (what the workflow exports in :data:`JOB_PARENT`)."""
    pid = os.getpid()
    return ProcessId(socket.gethostname(), pid, process_start(pid) or 0)


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def kill_children() -> int:
    """SIGKILL every descendant of this process (ranks it started, dataloader workers); how many there were."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    return len(children)


def exit_at_once(code: int) -> NoReturn:
    """End this process with ``code`` once its logs and standard streams are flushed, skipping the interpreter's
    teardown: torch's and gloo's C++ destructors took 3-8 s of every rank's end, after its work was done, and a
    job ends with its last rank. Call only once everything the process writes is in place (atomic writes)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_rank_now(reason: str, logger: logging.Logger, code: int = EXIT_CODE) -> None:
    """Log why (one line), kill this rank's child processes, and exit at once, whatever the other threads do."""
    logger.error("rasterscale: %s: ending this rank (pid %d)", reason, os.getpid())
    for handler in logger.handlers:
        handler.flush()
    kill_children()
    os._exit(code)


def end_on_sigterm(logger: logging.Logger) -> threading.Thread:
    """SIGTERM ends this rank at once (:func:`end_rank_now`, exit 143), from a thread woken by the signal.

    Not from a Python signal handler: Lightning installs its own at ``trainer.predict`` and runs it first, and it
    broadcasts over the process group, which blocks for good when a peer is dead. The interpreter's C-level handler
    writes every signal that has a Python handler to the wakeup fd before any Python handler runs; a thread reading
    that fd sees SIGTERM whatever the main thread is blocked in. Call from the main thread; once per process (a
    later call returns the first one's thread)."""
    global _SIGTERM_THREAD
    if _SIGTERM_THREAD is not None:
        return _SIGTERM_THREAD
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a Python handler, so it reaches the wakeup fd
    signal.set_wakeup_fd(write_end)

    def run() -> None:
        while signal.SIGTERM not in os.read(read_end, 64):
            pass
        end_rank_now("received SIGTERM", logger, SIGTERM_EXIT_CODE)

    _SIGTERM_THREAD = threading.Thread(target=run, name="rasterscale-sigterm", daemon=True)
    _SIGTERM_THREAD.start()
    return _SIGTERM_THREAD


def watch(
    process: ProcessId, what: str, logger: logging.Logger, poll_seconds: float = POLL_SECONDS
) -> threading.Thread:
    """A daemon thread that ends this rank (:func:`end_rank_now`) once ``process`` is gone."""

    def run() -> None:
        while process.alive():
            time.sleep(poll_seconds)
        end_rank_now(f"{what} (pid {process.pid} on {process.host}) is gone", logger)

    thread = threading.Thread(target=run, name="rasterscale-lifetime", daemon=True)
    thread.start()
    return thread


def check_launcher(logger: logging.Logger) -> None:
    """A rank started by another rank (:data:`RANK_LAUNCHER`) ends at once when that rank is no longer its parent:
    it died before this one could ask for the death signal."""
    launcher = ProcessId.parse(os.environ.get(RANK_LAUNCHER, ""))
    if launcher is None or not launcher.here:
        return
    if parent_pid(os.getpid()) != launcher.pid or not launcher.alive():
        end_rank_now(f"the rank that launched this one (pid {launcher.pid}) is gone", logger)


def bind_worker(worker_id: int, rank_pid: int) -> None:
    """A dataloader worker dies with its rank (``rank_pid``, the process that made the dataloader): the kernel's
    death signal, and an exit at once when the rank died before the worker could ask for it. ``worker_id`` is
    torch's ``worker_init_fn`` argument (unused)."""
    if die_with_parent() and os.getppid() != rank_pid:
        os._exit(EXIT_CODE)


def bind_rank(launches_ranks: bool, logger: logging.Logger, sigterm_ends: bool = False) -> None:
    """Tie this rank's life to its job's (module docstring): die with the parent, check the launching rank, watch
    the workflow's process; ``logger`` gets the one line said before a rank is ended. ``launches_ranks``: this
    process will start the other local ranks (rank 0, where Lightning's local launcher starts them), which then
    check that it is their parent. ``sigterm_ends``: SIGTERM ends the rank at once (prediction:
    :func:`end_on_sigterm`)."""
    if sigterm_ends:
        end_on_sigterm(logger)
    if not sys.platform.startswith("linux"):
        return
    die_with_parent()
    check_launcher(logger)
    if launches_ranks:
        os.environ[RANK_LAUNCHER] = str(this_process())
    job = ProcessId.parse(os.environ.get(JOB_PARENT, ""))
    if job is not None and job.here:
        what = "the workflow process that started this job"
        if not job.alive():
            end_rank_now(f"{what} (pid {job.pid} on {job.host}) is gone", logger)
        watch(job, what, logger)
