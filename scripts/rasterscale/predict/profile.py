"""Per-rank prediction profile: device memory per batch, device utilization, throughput and time waiting for data.

Like the seeds' mgpr summary, but every figure is measured over the whole run rather than sampled once:

- **time**: ``wall_s`` runs from the rank's setup (before its data are set up) to the end of its outputs' final
  write, and splits exactly into the **stage timeline** (``stages``: the rank's main thread, lap by lap,
  :class:`rasterscale.predict.measure.StageClock`): ``wait`` (for the next batch of tiles), ``h2d`` (its copy to
  the device and scaling there), ``forward``, ``post`` (the task's post-processing), ``d2h`` (results copied to the
  host while the rank waits), ``blend`` (the rank outputs taking the batch) and ``write`` (waiting for a writer
  thread, saved parts, the final write). ``compute_s`` is h2d + forward + post, ``output_s`` d2h + blend + write,
  ``wait_s`` the wait. Beside it (``parallel``): ``read``, the seconds the dataloader (its workers) spent reading
  the tiles, ``writer``, a writer thread's seconds writing the rank raster, and on a GPU ``device_h2d``,
  ``device_forward``, ``device_post``, the device's own time of those stages (CUDA events: the host only queues
  them).
- **device memory**: on a GPU, the peak that torch allocated during each batch (the peak is reset at every
  batch start); on a CPU, where the device's memory is the host's, the rank's resident set after each batch.
  ``memory_peak_mb`` is the largest, ``memory_mean_mb`` the mean over batches. ``host_rss_peak_mb`` is the
  rank process's true peak resident set (the kernel's high-water mark, VmHWM), ``workers_rss_peak_mb`` the
  largest resident set seen of one of its dataloader workers (sampled at most once a second).
- **utilization**: on a GPU, NVML's busy fraction sampled every 0.2 s by a thread for the whole wall; on a CPU,
  the rank's CPU time over wall x its threads (OpenMP threads waiting at a barrier spin and count as busy).

The Lightning callback that measures is :class:`rasterscale.predict.measure.PredictProfiler`; this module holds its
probes. What a profile record is, and how profiles are gathered and printed: :mod:`rasterscale.jobs.profile`.
Each rank stores its profile in its rank record (:mod:`rasterscale.jobs.rankfiles`).
"""

from __future__ import annotations

import multiprocessing
import resource
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

MB = 1024 * 1024
NVML_PERIOD_S = 0.2
WORKER_SAMPLE_PERIOD_S = 1.0


class UtilizationSampler:
    """NVML's GPU busy fraction sampled by a daemon thread until stopped; ``None`` when NVML is unavailable."""

    def __init__(self, device: Any, period: float = NVML_PERIOD_S) -> None:
        self.device, self.period = device, period
        self.samples: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        import torch

        while not self._stop.is_set():
            try:
                self.samples.append(torch.cuda.utilization(self.device) / 100.0)
            except Exception as err:  # no NVML library, driver or permission: report it, never fail the job
                self.error = f"{type(err).__name__}: {err}"
                return
            self._stop.wait(self.period)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=5)
        return sum(self.samples) / len(self.samples) if self.samples else None


def workers_rss() -> int:
    """Largest resident set of this process's dataloader workers (multiprocessing children), in bytes."""
    largest = 0
    for child in multiprocessing.active_children():
        try:
            largest = max(largest, psutil.Process(child.pid).memory_info().rss)
        except (psutil.Error, ValueError):
            continue
    return largest


def peak_rss() -> int:
    """This process's peak resident set in bytes: the kernel's high-water mark of this process image (VmHWM).

    getrusage's ru_maxrss is not used where VmHWM exists: it also counts the process this one was forked from
    before its exec (a rank started by a large parent would report the parent's size).
    """
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def rss_now() -> int:
    """This process's resident set now, in bytes."""
    return psutil.Process().memory_info().rss


def host_memory_total() -> int:
    return psutil.virtual_memory().total


def host_name() -> str:
    return socket.gethostname()
