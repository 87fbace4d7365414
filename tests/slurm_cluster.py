"""A throwaway Slurm cluster (one slurmctld, several slurmd "nodes") on loopback, for tests.

Everything the cluster writes (slurm.conf, munge key/socket/logs, state, spool, pid files, logs) lives under
the working directory handed to :class:`SlurmCluster`; the only system-wide change is one ``127.0.0.1 <node>``
line per node name in /etc/hosts (kept, idempotent), because the node names must resolve.

    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path) as cluster:
        cluster.run(["sbatch", "--parsable", "--wrap", "hostname"])

Checked with Debian 12's Slurm 22.05.8 and munge 0.5.15.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
REQUIRED_BINARIES = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "sinfo",
    "scontrol",
    "scancel",
    "munged",
    "mungekey",
)
# Daemons live in sbin; a non-login PATH may lack it.
_EXTRA_PATH = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
_HOSTS = Path("/etc/hosts")


def _which(name: str) -> str | None:
    path = os.environ.get("PATH", "")
    return shutil.which(name, path=os.pathsep.join([path, *_EXTRA_PATH]))


def _missing_binaries() -> list[str]:
    return [name for name in REQUIRED_BINARIES if _which(name) is None]


def _is_root() -> bool:
    return os.geteuid() == 0


def ensure_slurm_installed() -> str | None:
    """Return None when Slurm and munge are usable here, installing them with apt-get if needed and possible.

    Otherwise return a human-readable reason (for ``pytest.skip``). Package scripts are kept from starting
    system services during the install (a policy-rc.d that denies every start), so no system slurmctld, slurmd
    or munged is left running to collide with the test cluster.
    """
    missing = _missing_binaries()
    if not missing:
        return None
    if not _is_root():
        return f"Slurm/munge not installed ({', '.join(missing)} missing) and not root to install them"
    apt_get = _which("apt-get")
    if apt_get is None:
        return f"Slurm/munge not installed ({', '.join(missing)} missing) and no apt-get to install them"

    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", NEEDRESTART_MODE="a")
    install = [
        apt_get,
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "-o",
        "Dpkg::Options::=--force-confdef",
        "-o",
        "Dpkg::Options::=--force-confold",
        *SLURM_PACKAGES,
    ]
    outputs: list[str] = []

    def attempt(cmd: list[str]) -> bool:
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            outputs.append(f"$ {' '.join(cmd)}\n{exc}")
            return False
        outputs.append(f"$ {' '.join(cmd)} -> {proc.returncode}\n{(proc.stdout + proc.stderr)[-2000:]}")
        return proc.returncode == 0

    with _services_denied():
        ok = attempt(install) or (attempt([apt_get, "update", "-q"]) and attempt(install))
    if not ok:
        return "apt-get could not install " + " ".join(SLURM_PACKAGES) + ":\n" + "\n".join(outputs)[-3000:]
    missing = _missing_binaries()
    if missing:
        return f"after installing {' '.join(SLURM_PACKAGES)}, still missing: {', '.join(missing)}"
    return None


@contextlib.contextmanager
def _services_denied():
    """While inside, a policy-rc.d denies every service start by package scripts (invoke-rc.d).

    An existing policy-rc.d (Docker images ship one) is put back afterwards, byte for byte; ours is removed.
    """
    saved = None
    if _POLICY_RC_D.exists() or _POLICY_RC_D.is_symlink():
        saved = _POLICY_RC_D.with_name(f"policy-rc.d.slurm-cluster-{os.getpid()}")
        _POLICY_RC_D.rename(saved)
    try:
        _POLICY_RC_D.write_text("#!/bin/sh\n# written by tests/slurm_cluster.py during apt-get install\nexit 101\n")
        _POLICY_RC_D.chmod(0o755)
        yield
    finally:
        _POLICY_RC_D.unlink(missing_ok=True)
        if saved is not None:
            saved.rename(_POLICY_RC_D)


# ---------------------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------------------

# Every process the harness starts carries this variable (value: the cluster's unique name), and so do jobs
# submitted with `cluster.env`; `stop()` uses it to find this cluster's leftovers (slurmstepd, job processes).
MARKER_VAR = "RASTERSCALE_SLURM_CLUSTER"
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes including the NUL
# Job states after which squeue reports no further change.
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


class SlurmClusterError(RuntimeError):
    """The cluster could not be set up, booted or reached."""


def free_tcp_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (bound to port 0 together, read, then closed)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def ensure_hosts_entries(names: Sequence[str], address: str = "127.0.0.1") -> None:
    """Make each name resolve, appending `<address> <name>` to /etc/hosts where it is not listed (root only).

    The lines are kept (idempotent): other clusters and later runs reuse them.
    """
    text = _HOSTS.read_text() if _HOSTS.exists() else ""
    listed = {word for line in text.splitlines() for word in line.split("#", 1)[0].split()[1:]}
    missing = [name for name in dict.fromkeys(names) if name not in listed]
    if not missing:
        return
    if _is_root():
        with _HOSTS.open("a") as fh:  # append in place: /etc/hosts may be a bind mount in containers
            prefix = "" if not text or text.endswith("\n") else "\n"
            fh.write(prefix + "".join(f"{address} {name}\n" for name in missing))
        return
    unresolved = []
    for name in missing:
        try:
            socket.gethostbyname(name)
        except OSError:
            unresolved.append(name)
    if unresolved:
        raise SlurmClusterError(f"node names {unresolved} do not resolve and only root may add them to {_HOSTS}")


def _host_memory_mb() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 4096


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<{exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _clean_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment without Slurm's job/submission variables (this may run inside a job)."""
    env = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_"))
    }
    parts = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join([p for p in parts if p] + [p for p in _EXTRA_PATH if p not in parts])
    return env


class SlurmCluster:
    """A throwaway Slurm cluster on this host: munged, slurmctld and one slurmd per node name, on loopback.

    Use as a context manager (``with SlurmCluster(tmp) as cluster: ...``) or call :meth:`start` /
    :meth:`stop`. Needs root and the Debian packages (see :func:`ensure_slurm_installed`). Daemons run in the
    foreground as children of this process, so their pids are exact; :meth:`stop` cancels the jobs, stops
    slurmd, slurmctld and munged (SIGTERM, then SIGKILL) and then kills any leftover process of this cluster
    (slurmstepd, job processes), found by the :data:`MARKER_VAR` variable in its environment.

    ``env`` (pass it to subprocesses) is the current environment without SLURM_*/SBATCH_*/SRUN_* variables,
    plus ``SLURM_CONF`` and the marker; ``run()`` uses it.
    """

    def __init__(
        self,
        workdir: Path,
        nodes: Sequence[str] = ("n1", "n2"),
        cpus_per_node: int = 4,
        *,
        real_memory_mb: int | None = None,
        partition: str = "debug",
        boot_timeout: float = 30.0,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        self.workdir = Path(workdir).resolve()
        self.nodes: tuple[str, ...] = tuple(nodes)
        self.cpus_per_node = int(cpus_per_node)
        # Each "node" claims its share of this host's memory, so `--mem` requests are checked sensibly.
        self.real_memory_mb = int(real_memory_mb or max(1024, _host_memory_mb() // len(self.nodes)))
        self.partition = partition
        self.boot_timeout = boot_timeout
        self.cluster_name = "rs" + uuid.uuid4().hex[:12]  # unique per instance (Slurm lowercases it anyway)
        self.hostname = socket.gethostname()
        self.user = getpass.getuser()

        w = self.workdir
        self.conf_path = w / "slurm.conf"
        self.log_dir = w / "log"
        self.run_dir = w / "run"
        self.state_dir = w / "state"
        self.spool_dir = w / "spool"
        self.munge_dir = w / "munge"
        self.munge_key = self.munge_dir / "munge.key"
        self.munge_socket = self.munge_dir / "socket"
        self.ctld_port: int | None = None
        self.node_ports: dict[str, int] = {}
        self.env: dict[str, str] = _clean_env()
        self.env.update(SLURM_CONF=str(self.conf_path), **{MARKER_VAR: self.cluster_name})
        self._procs: dict[str, subprocess.Popen] = {}
        self._log_handles: list = []
        self._started = False
        self.boot_seconds: float | None = None

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> SlurmCluster:
        """Write the config, start munged, slurmctld and the slurmds, and wait until every node is idle."""
        if self._started:
            return self
        t0 = time.monotonic()
        self._started = True
        try:
            self._prepare()
            self._start_munged()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_daemon(
                    f"slurmd-{node}",
                    [self._bin("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)],
                )
            self.wait_idle(self.boot_timeout)
        except BaseException:
            self.stop()
            raise
        self.boot_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Cancel jobs, stop slurmd(s), slurmctld and munged, then kill any leftover of this cluster."""
        if not self._started:
            return
        self._started = False
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self._cancel_jobs()
        for name in [n for n in self._procs if n.startswith("slurmd-")]:
            self._stop_proc(name)
        self._stop_proc("slurmctld")
        self._kill_leftovers()
        self._stop_proc("munged")
        self._kill_leftovers()
        for fh in self._log_handles:
            fh.close()
        self._log_handles.clear()

    # ---------------------------------------------------------------- use

    @property
    def pids(self) -> dict[str, int]:
        """Daemon name (munged, slurmctld, slurmd-<node>) -> pid, for the daemons still running."""
        return {name: proc.pid for name, proc in self._procs.items() if proc.poll() is None}

    def run(self, cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        """Run a command against this cluster (with `.env`); text output captured, no check, 120 s limit."""
        kw.setdefault("env", self.env)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("check", False)
        kw.setdefault("timeout", 120)
        return subprocess.run(cmd, **kw)

    def node_states(self) -> dict[str, str]:
        """Node name -> compact state (`idle`, `alloc`, `mix`, `down*`, ...) as sinfo reports it."""
        proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15)
        if proc.returncode != 0:
            raise SlurmClusterError(f"sinfo failed ({proc.returncode}): {proc.stderr.strip()}")
        states: dict[str, str] = {}
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def job_state(self, job_id: str | int) -> str:
        """The state squeue reports for a job (PENDING, RUNNING, COMPLETED, FAILED, ...), '' if unknown.

        ``--states=all`` matters: without it squeue 22.05 omits finished jobs even when asked with ``-j``
        (the executor plugin's squeue status query passes it too).
        """
        proc = self.run(["squeue", "--states=all", "-j", str(job_id), "-h", "-o", "%T"], timeout=15)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def wait_job(self, job_id: str | int, timeout: float = 120.0) -> str:
        """Poll squeue until the job reaches a final state and return it; raise on timeout."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINAL_STATES:
                return state
            time.sleep(0.2)
        raise SlurmClusterError(f"job {job_id} not finished after {timeout:.0f} s (state {state!r})")

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until every node is idle; raise SlurmClusterError with the log tails otherwise."""
        deadline = time.monotonic() + timeout
        last = "sinfo not run yet"
        while True:
            self._check_alive()
            try:
                states = self.node_states()
                last = repr(states)
                if all(states.get(node) == "idle" for node in self.nodes):
                    return
            except (SlurmClusterError, subprocess.TimeoutExpired) as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"nodes not idle after {timeout:.0f} s (last: {last})\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of every daemon log of this cluster, for failure messages."""
        if not self.log_dir.is_dir():
            return "(no logs yet)"
        chunks = []
        for path in sorted(self.log_dir.iterdir()):
            if not path.is_file() or not path.stat().st_size:
                continue
            # Foreground slurm daemons print their log to stdout too: show the .stdout capture only where the
            # .log file is missing or empty (errors from before the log file was opened, e.g. a bad config).
            log_twin = path.with_suffix(".log")
            if path.suffix == ".stdout" and log_twin.is_file() and log_twin.stat().st_size:
                continue
            chunks.append(f"==> {path} <==\n{_tail(path, lines)}")
        return "\n".join(chunks) or "(logs empty)"

    # ---------------------------------------------------------------- internals

    @staticmethod
    def _bin(name: str) -> str:
        path = _which(name)
        if path is None:
            raise SlurmClusterError(f"{name} not found (run ensure_slurm_installed() first)")
        return path

    def _prepare(self) -> None:
        if not _is_root():
            raise SlurmClusterError("a local Slurm cluster needs root (slurmd runs jobs as their users)")
        if self.workdir.exists() and any(self.workdir.iterdir()):
            raise SlurmClusterError(f"{self.workdir} is not empty; give each cluster a fresh directory")
        # Unix socket paths are short: munged's, and slurmstepd's <spool>/<node>/<node>_<jobid>.<stepid> (the
        # batch step is 4294967291; job ids of a fresh cluster stay far below 7 digits).
        longest = max(
            len(str(self.munge_socket)),
            len(str(self.spool_dir)) + 2 * max(map(len, self.nodes)) + len("//_9999999.4294967291"),
        )
        if longest > _UNIX_PATH_MAX:
            raise SlurmClusterError(
                f"{self.workdir} is too long for the Unix sockets under it ({longest} > {_UNIX_PATH_MAX})"
            )
        node_spools = [self.spool_dir / node for node in self.nodes]
        for d in (self.log_dir, self.run_dir, self.state_dir, self.munge_dir, *node_spools):
            d.mkdir(parents=True, exist_ok=True)
        ensure_hosts_entries(self.nodes)
        ports = free_tcp_ports(1 + len(self.nodes))
        self.ctld_port = ports[0]
        self.node_ports = dict(zip(self.nodes, ports[1:], strict=True))
        self.conf_path.write_text(self.render_conf())

    def render_conf(self) -> str:
        lines = [
            "# Throwaway test cluster written by tests/slurm_cluster.py; every path is under this folder.",
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.state_dir}",
            f"SlurmdSpoolDir={self.spool_dir}/%n",
            f"SlurmctldPidFile={self.run_dir}/slurmctld.pid",
            f"SlurmdPidFile={self.run_dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log_dir}/slurmctld.log",
            f"SlurmdLogFile={self.log_dir}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups, no database.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobContainerType=job_container/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            # Start batch jobs right away (the default batch_sched_delay=3 holds each submission ~3 s).
            "SchedulerParameters=batch_sched_delay=0",
            # Trust the CPUs/RealMemory written here even where the host has fewer (both "nodes" share it).
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=30",
            "KillWait=5",
            "WaitTime=0",
            "MessageTimeout=10",
            # Keep finished jobs in squeue for 5 minutes: without slurmdbd/sacct, states are polled there.
            "MinJobAge=300",
            "MailProg=/bin/true",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={self.hostname} NodeAddr=127.0.0.1"
                f" Port={self.node_ports[node]} CPUs={self.cpus_per_node}"
                f" RealMemory={self.real_memory_mb} State=UNKNOWN"
            )
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon_env(self) -> dict[str, str]:
        env = _clean_env()
        env.update(SLURM_CONF=str(self.conf_path), **{MARKER_VAR: self.cluster_name})
        return env

    def _start_daemon(self, name: str, cmd: list[str], output: Path | None = None) -> subprocess.Popen:
        out = (output or self.log_dir / f"{name}.stdout").open("ab")
        self._log_handles.append(out)
        proc = subprocess.Popen(
            cmd,
            cwd=self.workdir,
            env=self._daemon_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # keep terminal signals (Ctrl-C to pytest) away; stop() ends it
        )
        self._procs[name] = proc
        return proc

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmClusterError(f"{name} exited with {proc.returncode} during boot\n{self.log_tail()}")

    def _wait_for(self, what: str, predicate: object, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # type: ignore[operator]
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_tail()}")
            time.sleep(0.1)

    def _start_munged(self) -> None:
        self.munge_dir.chmod(0o700)
        proc = subprocess.run(
            [self._bin("mungekey"), "--create", "--keyfile", str(self.munge_key)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            # Older munge packages lack mungekey: 1024 random bytes make a key just as well.
            self.munge_key.write_bytes(os.urandom(1024))
        self.munge_key.chmod(0o400)
        # --force: munged wants world-executable parents for its socket directory; pytest's tmp dirs are 0700
        # (only root talks to this munged, so the warning is harmless). -F keeps it a child: its pid is exact.
        self._start_daemon(
            "munged",
            [
                self._bin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={self.munge_key}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
                "--num-threads=2",
            ],
            output=self.log_dir / "munged.log",  # in the foreground munged logs to stderr, not --log-file
        )
        self._wait_for("munged's socket", self.munge_socket.exists)

    def _start_slurmctld(self) -> None:
        # -i: ignore (absent) state, -D: foreground.
        self._start_daemon("slurmctld", [self._bin("slurmctld"), "-D", "-i", "-f", str(self.conf_path)])

        def up() -> bool:
            proc = self.run(["scontrol", "ping"], timeout=15)
            return proc.returncode == 0 and "UP" in proc.stdout

        self._wait_for("slurmctld to answer `scontrol ping`", up, timeout=self.boot_timeout)

    def _cancel_jobs(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.run(["scancel", "--full", "-u", self.user], timeout=15)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                proc = self.run(["squeue", "-h", "-t", "PD,R,CG,S,CF", "-o", "%i"], timeout=15)
                if proc.returncode != 0 or not proc.stdout.strip():
                    break
                time.sleep(0.25)

    def _stop_proc(self, name: str, grace: float = 10.0) -> None:
        proc = self._procs.get(name)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)

    def _kill_leftovers(self) -> None:
        """SIGKILL processes carrying this cluster's marker (slurmstepd, job processes), never this one."""
        own = {os.getpid(), os.getppid()}
        needle = f"{MARKER_VAR}={self.cluster_name}".encode()
        daemon_pids = {p.pid for p in self._procs.values() if p.poll() is None}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in own or pid in daemon_pids:
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def slurm_cluster_or_skip(tmp_dir: Path, **kwargs: object) -> SlurmCluster:
    """A started SlurmCluster under `tmp_dir`, or pytest.skip when Slurm can't be installed or we aren't root.

    The caller stops it (``cluster.stop()`` or ``with slurm_cluster_or_skip(tmp) as cluster:``). A cluster
    that is installed but fails to boot raises SlurmClusterError: that is a failure, not a skip.
    """
    import pytest

    if not _is_root():
        pytest.skip("a local Slurm cluster needs root (slurmd and munged run as root)")
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    return SlurmCluster(tmp_dir, **kwargs).start()  # type: ignore[arg-type]
