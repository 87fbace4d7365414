"""A job's local ranks start together, once the job's process (local rank 0) has imported the package: it forks the
node's other ranks (Linux), which begin with torch, Lightning and the engine already loaded, so that a node imports
them once, not once per rank (each rank's import cost 5-6 s of CPU; eight ranks read the environment's files from a
shared filesystem once, not eight times), and every rank then loads its model and reads its scenes at the same
time (as torchrun does). Lightning's own local launcher started them only once rank 0 had done all that, inside
``trainer.fit``/``trainer.predict``: every job paid the start of one rank, then of the others. The fork comes
before anything starts a thread of its own or touches a GPU (it checks both); elsewhere than on Linux the ranks
are started as new processes with the same command line.

The ranks learn their place from the variables Lightning's launcher sets (``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``); with ``LOCAL_RANK`` set, Lightning's ``LightningEnvironment`` says
the processes were created externally and starts none. Under srun Slurm starts every rank, and a job inside a
Slurm allocation that srun did not start is refused by the pre-flight checks: nothing is started here in either
case, nor for a one-rank job.

Rank 0 watches the ranks it started (:class:`LocalRanks`): when one exits with an error, it kills the others and
exits with one line (``rank 0: ending: rank 1 failed (see its line above)`` where that rank said why:
:mod:`rasterscale.runtime.peers`). One that exits with the code of a stop on SIGTERM (143: a training job stops on
all its ranks at the same step, once its checkpoint is written) leaves rank 0 :data:`STOP_GRACE_SECONDS` to stop on
its own; the job then exits with 143, not as a failure. A rank started here dies with rank 0
(:mod:`rasterscale.runtime.lifetime`, which reads :data:`~rasterscale.runtime.lifetime.RANK_LAUNCHER`). Entry
scripts import what their ranks run, then call :func:`start_local_ranks`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn, Protocol

from rasterscale.runtime import peers
from rasterscale.runtime.lifetime import RANK_LAUNCHER, SIGTERM_EXIT_CODE, exit_at_once, kill_children, this_process
from rasterscale.runtime.preflight import launch_geometry, slurm_job_id
from rasterscale.settings import Settings

POLL_SECONDS = 0.5
EXIT_WAIT_SECONDS = 120.0  # how long rank 0, done, waits for the ranks it started to exit
STOP_GRACE_SECONDS = 20.0  # how long rank 0 has to stop on its own once a rank it started stopped on SIGTERM
PLACE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
FORKS_RANKS = sys.platform.startswith("linux")  # elsewhere (macOS: fork after loading system frameworks) new processes


def starts_local_ranks(ranks: int, nodes: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process starts the job's other ranks: a job of several ranks on this one node, outside Slurm,
    in a process that is not itself a rank started by another (``LOCAL_RANK``)."""
    env = os.environ if env is None else env
    return ranks > 1 and nodes == 1 and "LOCAL_RANK" not in env and slurm_job_id(env) is None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environments(ranks: int, base: Mapping[str, str], port: int, launcher: str) -> list[dict[str, str]]:
    """The environment of each local rank (rank 0's first): its place in the job, and for the ranks started here
    the process that started them."""
    place = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0", "WORLD_SIZE": str(ranks)}
    environments = [{**base, **place, "LOCAL_RANK": "0"}]
    environments += [{**base, **place, "LOCAL_RANK": str(k), RANK_LAUNCHER: launcher} for k in range(1, ranks)]
    return environments


class RankProcess(Protocol):
    """A rank this process started: a :class:`ForkedRank`, or a ``subprocess.Popen``."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedRank:
    """A rank forked from this process, with ``subprocess.Popen``'s ``poll`` and ``wait``: its exit code, negative
    for a signal, None while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._reaping = threading.Lock()  # polled by the watching thread while the main thread waits

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"local rank (pid {self.pid})", timeout or 0.0)
            time.sleep(0.05)
        return code


class LocalRanks:
    """The ranks this process started (none where it starts none), watched from a daemon thread: one that exits
    with an error ends the job (:meth:`end_job`). :meth:`finish` at a rank's normal end."""

    def __init__(self, processes: Sequence[RankProcess] = ()) -> None:
        self.processes = list(processes)
        self.done = threading.Event()
        if self.processes:
            threading.Thread(target=self._watch, name="rasterscale-local-ranks", daemon=True).start()

    def failed(self) -> tuple[int, int] | None:
        """The first started rank that exited with an error: (local rank, exit code)."""
        for local_rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code:
                return local_rank, code
        return None

    def _watch(self) -> None:
        stopped_since: float | None = None
        while not self.done.wait(POLL_SECONDS):
            failure = self.failed()
            if failure is None:
                continue
            if failure[1] != SIGTERM_EXIT_CODE:
                self.end_job(*failure)
            stopped_since = stopped_since or time.monotonic()
            if time.monotonic() - stopped_since > STOP_GRACE_SECONDS:
                self.end_job(*failure)

    def end_job(self, local_rank: int, code: int) -> None:
        """A rank failed, or stopped on SIGTERM while rank 0 did not: kill every process this one started, and exit
        at once with one line (with 143 after a stop, else 1)."""
        pid = self.processes[local_rank - 1].pid
        if code == SIGTERM_EXIT_CODE:
            line = f"local rank {local_rank} (pid {pid}) stopped on SIGTERM and rank 0 did not: ending the job"
        elif local_rank in peers.failed_peers(0):  # it said why: one node, so its local rank is its rank
            line = peers.ending_line(0, [local_rank]).removeprefix("rasterscale: ")
        else:
            line = f"local rank {local_rank} (pid {pid}) exited with code {code}: ending the job's other ranks"
        peers.say_once(f"rasterscale: {line}")
        kill_children()
        os._exit(SIGTERM_EXIT_CODE if code == SIGTERM_EXIT_CODE else 1)

    def wait(self, timeout: float = EXIT_WAIT_SECONDS) -> None:
        """Rank 0 is done: wait for the ranks it started to exit; one that failed fails the job."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.done.set()
        failure = self.failed()
        if failure is not None:
            self.end_job(*failure)
        if any(process.poll() is None for process in self.processes):
            raise SystemExit(f"rasterscale: the job's other ranks were still running {timeout:.0f} s after rank 0")

    def finish(self) -> NoReturn:
        """This rank's work is done and written: wait for the ranks it started (:meth:`wait`), then exit 0 at once
        (:func:`~rasterscale.runtime.lifetime.exit_at_once`), without the seconds of the interpreter's teardown."""
        self.wait()
        exit_at_once(0)


def check_forkable() -> None:
    """The fork is safe: no thread of this process' own is running yet and no GPU has been touched (a CUDA context
    does not survive a fork). A failure here is a change in what the entries import, not a user's error."""
    threads = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
    if threads:
        raise RuntimeError(f"rasterscale: cannot fork the local ranks: threads already run ({', '.join(threads)})")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("rasterscale: cannot fork the local ranks: CUDA is already initialized in rank 0")


def fork_ranks(environments: Sequence[Mapping[str, str]]) -> LocalRanks:
    """Fork one rank per environment. In each forked rank this returns no ranks (it starts none) with the
    environment its own; in this process, the ranks it forked."""
    check_forkable()
    sys.stdout.flush()
    sys.stderr.flush()
    forked: list[RankProcess] = []
    for environment in environments:
        pid = os.fork()
        if pid == 0:
            os.environ.clear()
            os.environ.update(environment)
            return LocalRanks()
        forked.append(ForkedRank(pid))
    return LocalRanks(forked)


def start_local_ranks(settings: Settings, section: str, argv: Sequence[str] | None = None) -> LocalRanks:
    """Start the other local ranks of this job of ``section`` (``train``, ``predict``), when this process starts
    them (:func:`starts_local_ranks`): forked (:func:`fork_ranks`), or elsewhere than on Linux new processes with
    the same command line (``argv``, this process' by default)."""
    geometry = launch_geometry(settings, section)
    if not starts_local_ranks(geometry.world_size, geometry.nodes):
        return LocalRanks()
    environments = rank_environments(geometry.world_size, os.environ, free_port(), str(this_process()))
    os.environ.update({name: environments[0][name] for name in PLACE_VARIABLES})
    if FORKS_RANKS:
        return fork_ranks(environments[1:])
    script, *arguments = argv or sys.argv
    command = [sys.executable, os.path.abspath(script), *arguments]
    return LocalRanks([subprocess.Popen(command, env=env) for env in environments[1:]])
