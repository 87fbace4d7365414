"""The workflow's job processes in the tests, each a fork of one process that has imported what the jobs import
(one such process per test worker, beside tests/snakemake_forks.py's helper).

Every job of a local run is ``python scripts/<entry>.py ...`` (or a Snakemake ``script:``'s temporary script): a
fresh interpreter that imports torch, Lightning, torchvision and the package before it reads its job file. On a
slow 2-core machine that is 10-12 s of CPU for each prediction or training job and 1.5-2.5 s for each merge, tile
or score job, and the suite starts a few hundred of them: about a third of its time.

Here a process (the *zygote*) imports the entries' modules once; the forked snakemake of each test command
(tests/snakemake_forks.py) then sees, as its ``sys.executable``, a small client (:func:`write_client`) instead of
Python. The client hands its command line, working directory, environment and standard file descriptors to the
zygote over a Unix socket; the zygote forks a child that becomes the command: it takes those descriptors, folder and
environment, a process group of its own, and runs the script as ``__main__`` (``runpy``), exactly as the
interpreter would once its imports were done, with its exit status (or the signal that ended it) handed back as
the client's own. Signals sent to the client go to the child's process group; a client that dies (``kill -9``)
takes the child's process group with it. What the child shares with its siblings is only what the imports made:
the zygote runs nothing else, and forks only while it runs no thread.

Anything the zygote cannot be is a plain interpreter: ``python -c``/``-m`` and scripts outside this checkout go
to the real Python, as does every command when ``RASTERSCALE_TEST_JOB_FORKS=0``. Tests that look at the job
processes themselves (the fault tests, which find ranks by their command line and kill them; Slurm, whose jobs
start elsewhere; an environment of the test's own) run their snakemake as a plain subprocess, and so their jobs
as plain interpreters.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOCKET_ENV = "RASTERSCALE_TEST_JOB_ZYGOTE"  # the zygote's socket, in the environment the client runs in
ENABLED = os.environ.get("RASTERSCALE_TEST_JOB_FORKS", "1") != "0" and sys.platform.startswith("linux")
HEAVY = ("torch", "torchvision", "lightning.pytorch", "segmentation_models_pytorch", "snakemake.script")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

CLIENT = '''#!{python} -IS
"""A job's python for the tests (tests/job_forks.py): the command runs in a fork of the zygote at {socket_env},
its exit status this process's; anything it cannot run, the real Python ({python}) runs."""
import json, os, signal, socket, struct, sys

PYTHON = {python!r}
path = os.environ.get({socket_env!r}, "")
args = sys.argv[1:]
if not path or not args or args[0].startswith("-"):
    os.execv(PYTHON, [PYTHON, *args])
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    connection.connect(path)
except OSError:
    os.execv(PYTHON, [PYTHON, *args])
request = json.dumps({{"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(connection, [struct.pack("!Q", len(request))], [0, 1, 2])
connection.sendall(request)
replies = connection.makefile("r")
first = replies.readline().split()
if first != [] and first[0] == "plain":
    os.execv(PYTHON, [PYTHON, *args])
if len(first) != 2 or first[0] != "pid":
    sys.exit("job_forks: the zygote did not start the job")
pid = int(first[1])

def forward(number, frame):
    try:
        os.killpg(pid, number)
    except ProcessLookupError:
        pass

for number in {signals!r}:
    signal.signal(number, forward)
last = replies.readline().split()
if len(last) != 2 or last[0] != "exit":
    sys.exit("job_forks: the zygote ended before the job")
code = int(last[1])
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


def write_client(folder: Path, python: str = sys.executable) -> Path:
    """The client executable in ``folder`` (what a forked snakemake takes as ``sys.executable``)."""
    path = folder / "python"
    path.write_text(CLIENT.format(python=python, socket_env=SOCKET_ENV, signals=tuple(int(s) for s in SIGNALS)))
    path.chmod(0o755)
    return path


def entry_modules() -> list[str]:
    """The modules the entry scripts (scripts/*.py) import at their top."""
    names: list[str] = []
    for script in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.parse(script.read_text()).body:
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.append(node.module)
    return list(dict.fromkeys(names))


def preload() -> dict[str, str]:
    """Import what the jobs import; the environment variables those imports set (a child sets them again after it
    takes its command's environment, as its own imports would have)."""
    sys.path.insert(0, str(REPO / "scripts"))
    before = dict(os.environ)
    for name in (*HEAVY, *entry_modules()):
        try:
            importlib.import_module(name)
        except Exception:  # a job that needs it fails in its own import, as it would
            continue
    return {key: value for key, value in os.environ.items() if before.get(key) != value}


def forkable(argv: list[str]) -> bool:
    """A script of this checkout's (an entry, a bench) or a Snakemake ``script:``'s temporary script, run as
    ``python SCRIPT ...``."""
    script = Path(argv[0]).resolve() if argv and not argv[0].startswith("-") else None
    if script is None or script.suffix != ".py" or not script.is_file():
        return False
    ours = script.is_relative_to(REPO / "scripts") or script.is_relative_to(REPO / "bench")
    return ours or script.parent.parts[-2:] == (".snakemake", "scripts")


def exit_code(error: SystemExit) -> int:
    """The interpreter's exit status for ``error`` (a message is printed and exits 1)."""
    if error.code is None or isinstance(error.code, int):
        return error.code or 0
    print(error.code, file=sys.stderr)
    return 1


def become(request: dict, fds: list[int], imported_env: dict[str, str], client: str) -> None:
    """In the fork: become the command and never return."""
    code = 1
    try:
        os.setpgid(0, 0)
        for fd, target in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update({key: value for key, value in imported_env.items() if key not in request["env"]})
        for number in SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        script = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        sys.executable = client  # what the command starts as Python (a bench's jobs) is forked too
        sys.path[0] = os.path.dirname(script)  # python SCRIPT puts the script's folder first
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as error:
            code = exit_code(error)
        except KeyboardInterrupt:
            code = -signal.SIGINT
        except BaseException:  # the interpreter's own report of an uncaught exception
            sys.excepthook(*sys.exc_info())
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  (the interpreter joins non-daemon threads)
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """A client's request (its argv, cwd, environment) and its standard file descriptors."""
    header, fds, _, _ = socket.recv_fds(connection, 8, 3)
    (size,) = struct.unpack("!Q", header)
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return json.loads(data), fds


def serve(path: str, client: str) -> None:
    """The zygote: listen at ``path``, preload, then fork a child per request; ends when its stdin closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.binding")
    listener.listen(64)
    os.rename(f"{path}.binding", path)  # the path appears only once it accepts
    imported_env = preload()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print of the zygote's must not go anywhere
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: Children = {}
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    for _, pid in children.values():
                        kill_group(pid)
                    return
            elif key.data == "accept":
                connection, _ = listener.accept()
                start(connection, imported_env, selector, children, listener, client)
            elif key.data[0] == "child":
                ended(key.fd, selector, children)
            else:  # the client's connection: readable only once it went away (killed: its job goes with it)
                selector.unregister(key.fileobj)
                kill_group(key.data[1])


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


Children = dict[int, tuple[socket.socket, int]]  # a running job's pidfd -> (its client's connection, its pid)


def start(
    connection: socket.socket,
    imported_env: dict[str, str],
    selector: selectors.BaseSelector,
    children: Children,
    listener: socket.socket,
    client: str,
) -> None:
    """Take a client's request: fork its job (or tell it to run the plain interpreter) and watch both."""
    try:
        request, fds = receive(connection)
    except (ConnectionError, OSError, ValueError):
        connection.close()
        return
    threads = [thread for thread in threading.enumerate() if thread is not threading.main_thread()]
    if threads or not forkable(request["argv"]):
        for fd in fds:
            os.close(fd)
        connection.sendall(b"plain\n")
        connection.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        selector.close()
        listener.close()
        for other, _ in children.values():
            other.close()
        connection.close()
        become(request, fds, imported_env, client)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = (connection, pid)
    selector.register(pidfd, selectors.EVENT_READ, ("child", pid))
    selector.register(connection, selectors.EVENT_READ, ("client", pid))
    try:
        connection.sendall(f"pid {pid}\n".encode())
    except OSError:
        kill_group(pid)


def ended(pidfd: int, selector: selectors.BaseSelector, children: Children) -> None:
    """A job ended: reap it and tell its client how."""
    connection, pid = children.pop(pidfd)
    selector.unregister(pidfd)
    with contextlib.suppress(KeyError):  # unless it went away before (serve)
        selector.unregister(connection)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    connection.close()


class Zygote:
    """The test worker's zygote process, its socket and the client snakemake forks run their jobs with."""

    def __init__(self, folder: Path) -> None:
        self.socket = str(folder / "zygote.sock")
        self.client = write_client(folder)
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.socket, str(self.client)],
            stdin=subprocess.PIPE,
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30  # it listens before it imports (clients then wait for it)
        while not os.path.exists(self.socket) and self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def environment(self) -> dict[str, str]:
        """This process's environment with the zygote's socket: where the client forks its command."""
        return {**os.environ, SOCKET_ENV: self.socket}

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
