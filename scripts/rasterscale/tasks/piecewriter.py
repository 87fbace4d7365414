"""Finished pieces of a blended rank raster, from the rank's device to the raster, off the rank's main thread.

A piece finished on the device (its bands, a tensor) is handed to :class:`PieceWriter`: on a GPU it is copied into a
pinned host buffer with a non-blocking copy on a stream of its own (ordered after the work that made it by an event),
so the main thread goes on to the next batch at once. On a CPU the writer thread also finishes the piece: it is
handed the sums and what makes them the raster's bands (:meth:`PieceWriter.submit_unfinished`: an argmax, a mean),
which then run beside the rank's main thread instead of between two of its batches. A writer thread takes the pieces
in order, waits for each copy to land (or finishes the piece), and puts it into the rank raster (which writes the
blocks it completes). The queue is bounded, in pieces and in unfinished sums' bytes: a main thread that outruns the
writer waits, and that wait is the stage timeline's ``write``.

What the writer thread does is serialized with what the main thread asks of the raster by :meth:`PieceWriter.drain`
(parts, close): they run once every piece handed over is in. A failure in the writer thread (a full disk, a GDAL
error) is raised in the main thread at its next call, and nothing more is written.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from rasterio.windows import Window

QUEUE_PIECES = 256  # pieces waiting for the writer before the main thread waits (a few batches' worth)
QUEUE_BYTES = 64 * 2**20  # bytes of unfinished sums waiting for the writer before the main thread waits

Put = Callable[[Window, np.ndarray], None]
Placement = tuple[Window, tuple[slice, slice]]  # a window of the raster, and the rows and columns of the data there
Finish = Callable[[torch.Tensor], torch.Tensor]  # sums to the raster's bands


class PieceWriter:
    """Puts finished pieces into a raster (``put(window, data)``) from a thread of its own, in the order given."""

    def __init__(self, put: Put, device: torch.device, name: str = "rank raster") -> None:
        self.put, self.device = put, device
        self.queue: queue.Queue[tuple[Any, list[Placement], Any, int] | None] = queue.Queue(maxsize=QUEUE_PIECES)
        self.error: BaseException | None = None
        self.busy_s = 0.0  # the writer thread's time putting pieces (its share of the stage timeline's write)
        self.blocked_s = 0.0  # the main thread's time waiting for the writer (a full queue, a drain)
        self.held_bytes = 0  # of unfinished sums handed over and not yet put
        self.room = threading.Condition()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, name=f"writer of {name}", daemon=True)
        self.thread.start()

    def submit(self, data: torch.Tensor, placements: list[Placement]) -> None:
        """Hand over finished data (bands, h, w) on the device, and where its parts go in the raster: copied to the
        host without waiting, put later."""
        self.raise_failure()
        host, ready = self._to_host(data)
        started = time.perf_counter()
        self.queue.put((host, placements, ready, 0))
        self.blocked_s += time.perf_counter() - started

    def submit_unfinished(self, sums: torch.Tensor, finish: Finish, placements: list[Placement]) -> None:
        """Hand over sums on the host that ``finish`` makes into the data to put, in the writer thread: a CPU rank's
        main thread goes on to the next batch while its writer finishes the rows. ``sums`` (a view: its whole
        storage) is held until then, at most :data:`QUEUE_BYTES` of such sums at once."""
        self.raise_failure()
        nbytes = sums.untyped_storage().nbytes()
        started = time.perf_counter()
        with self.room:
            self.room.wait_for(lambda: not self.held_bytes or self.held_bytes + nbytes <= QUEUE_BYTES or self.error)
            self.held_bytes += nbytes
        self.queue.put((functools.partial(finish, sums), placements, None, nbytes))
        self.blocked_s += time.perf_counter() - started

    def _to_host(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.stream is None:
            return data, None
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(data, non_blocking=True)
            data.record_stream(self.stream)  # the device memory is not reused before the copy is done
            ready = torch.cuda.Event(blocking=True)  # the writer sleeps until the copy is done, not spinning a core
            ready.record(self.stream)
        return host, ready

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    host, placements, ready, _ = item
                    started = time.perf_counter()
                    if ready is not None:
                        ready.synchronize()
                    array = (host() if callable(host) else host).numpy()
                    for window, (rows, cols) in placements:
                        self.put(window, array[:, rows, cols])
                    self.busy_s += time.perf_counter() - started
            except BaseException as err:  # raised in the main thread at its next call
                self.error = err
            finally:
                if item is not None and item[3]:
                    with self.room:
                        self.held_bytes -= item[3]
                        self.room.notify_all()
                self.queue.task_done()

    def raise_failure(self) -> None:
        """Raise the writer thread's failure (it stays: nothing more is written)."""
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        """Wait until every piece handed over is in the raster; raise the writer's failure, if any."""
        started = time.perf_counter()
        self.queue.join()
        self.blocked_s += time.perf_counter() - started
        self.raise_failure()

    def stop(self) -> None:
        """End the writer thread (after the pieces handed over); idempotent."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
