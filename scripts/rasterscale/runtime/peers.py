"""A rank whose peer failed ends with one line, not a traceback.

A rank that fails says why in the rule's log (an input error's one line, or its traceback) and leaves a marker,
``rank-<rank>.failed`` beside its own log (:func:`mark_failed`, before it exits: its peers' connections to it
close only then). A peer waiting for it in a collective (the final gather of prediction, a training step's
all-reduce) gets gloo's "Connection closed by peer" (or NCCL's error, or a timeout); it reads the markers
(:func:`failed_peers`) and ends with ``rasterscale: rank 0: ending: rank 1 failed (see its line above)`` (its
traceback stays in its own log), exit 1. Rank 0's watch of the ranks it started
(:class:`rasterscale.runtime.launch.LocalRanks`) ends with the same line; whichever comes first says it
(:func:`say_once`).

A marker holds the job's launch (:func:`launch_token`: its rendezvous address and port, its Slurm job and step), so a
marker a failed run left in the same log folder is not taken for this run's; a rank also removes its own marker
when it starts (:func:`start`). Torch-free: :mod:`rasterscale.runtime.launch` imports it before torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

MARKER = "rank-{rank}.failed"
PEER_WAIT_SECONDS = 5.0  # how long a rank whose connection broke waits for its peer's marker (a shared file system)
POLL_SECONDS = 0.2
TOKEN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID")
# what a collective raises when a peer is gone: gloo's "Connection closed by peer", a reset, a timeout, NCCL's abort
PEER_WORDS = ("closed by peer", "reset by peer", "broken pipe", "timed out", "timeout", "nccl")

_folder: Path | None = None
_said = threading.Lock()  # held for good by the first end said (:func:`say_once`)


def launch_token() -> str:
    """This launch of the job: the same on every rank, another for a rerun."""
    return "|".join(os.environ.get(name, "") for name in TOKEN_VARIABLES)


def start(folder: str | Path, rank: int) -> None:
    """This rank's markers live in ``folder`` (its log folder); a marker of an earlier run of this rank goes."""
    global _folder
    _folder = Path(folder)
    with contextlib.suppress(OSError):
        (_folder / MARKER.format(rank=rank)).unlink()


def mark_failed(rank: int, line: str) -> None:
    """This rank failed (``line``: what it said): its peers will say so instead of their own tracebacks."""
    if _folder is None:
        return
    path = _folder / MARKER.format(rank=rank)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(OSError):
        temporary.write_text(json.dumps({"token": launch_token(), "line": line}))
        os.replace(temporary, path)


def failed_peers(rank: int, wait: float = 0.0) -> list[int]:
    """The other ranks of this launch that marked themselves failed, waiting up to ``wait`` seconds for one."""
    deadline = time.monotonic() + wait
    while True:
        found = sorted(r for r in _marked() if r != rank)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(POLL_SECONDS)


def _marked() -> list[int]:
    if _folder is None:
        return []
    ranks, token = [], launch_token()
    for path in _folder.glob(MARKER.format(rank="*")):
        number = path.name.split("-", 1)[1].split(".", 1)[0]
        with contextlib.suppress(OSError, ValueError, TypeError):
            if number.isdigit() and json.loads(path.read_text())["token"] == token:
                ranks.append(int(number))
    return ranks


def is_peer_error(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer is gone (torch's ``DistError`` family, or a
    RuntimeError in gloo's or NCCL's words)."""
    if any(cls.__name__.startswith("Dist") for cls in type(error).__mro__):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in PEER_WORDS)


def ending_line(rank: int, failed: list[int], log_dir: str | Path | None = None) -> str:
    """The one line of a rank that ends because ``failed`` did (none known: a peer gone without a word)."""
    if failed:
        which = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
        see = "its line" if len(failed) == 1 else "their lines"
        return f"rasterscale: rank {rank}: ending: {which} failed (see {see} above)"
    where = f" (the ranks' logs are in {log_dir})" if log_dir is not None else ""
    return (
        f"rasterscale: rank {rank}: ending: a peer rank is gone without a line (killed? out of memory?), so the "
        f"job's collectives broke{where}"
    )


def say_once(line: str) -> bool:
    """Write ``line`` to the rule's log unless an ending was already said in this process; whether it was written.
    Written to the process' own stderr: torch's rank prefix (its excepthook) does not reach it, nor is it lost to a
    buffer at an exit at once."""
    if not _said.acquire(blocking=False):
        return False
    stream = sys.__stderr__ or sys.stderr
    stream.write(line + "\n")
    stream.flush()
    return True
