"""The rank raster's writer thread (rasterscale.tasks.piecewriter): on a CPU it finishes the sums it is handed
beside the main thread, puts the pieces in the order given, holds at most QUEUE_BYTES of unfinished sums (the main
thread waits beyond), and a failure of its own is raised in the main thread with every byte let go."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from rasterio.windows import Window

from rasterscale.tasks import piecewriter
from rasterscale.tasks.piecewriter import PieceWriter

MB = 2**20


def doubled(sums: torch.Tensor) -> torch.Tensor:
    """A finish: the raster's band is twice the sums, as bytes."""
    return (sums * 2).to(torch.uint8)


def test_unfinished_sums_are_finished_by_the_writer_in_order_within_the_byte_bound(monkeypatch):
    monkeypatch.setattr(piecewriter, "QUEUE_BYTES", 2 * MB)
    gate, put, finished_in = threading.Event(), [], []

    def finish(sums: torch.Tensor) -> torch.Tensor:
        finished_in.append(threading.current_thread().name)
        return doubled(sums)

    def slow_put(window: Window, data: np.ndarray) -> None:
        gate.wait(10)
        put.append((window.col_off, data.copy(), threading.current_thread().name))

    writer = PieceWriter(slow_put, torch.device("cpu"), "test raster")
    sums = [torch.full((1, 512, 512), float(k)) for k in range(4)]  # 1 MiB each
    placement = [(Window(0, 0, 4, 2), (slice(0, 2), slice(0, 4)))]

    def hand_over() -> None:
        for k, one in enumerate(sums):
            writer.submit_unfinished(one, finish, [(Window(k, 0, 4, 2), placement[0][1])])

    handed = threading.Thread(target=hand_over)
    handed.start()
    time.sleep(0.5)
    # the first is being put (held), the second waits in the queue: the third would pass the bound
    assert writer.held_bytes == 2 * MB and handed.is_alive()
    gate.set()
    handed.join(10)
    writer.drain()
    writer.stop()
    assert [col for col, _, _ in put] == [0, 1, 2, 3]  # in the order given
    assert all((data == 2 * k).all() and data.dtype == np.uint8 for k, (_, data, _) in enumerate(put))
    assert {name for _, _, name in put} | set(finished_in) == {"writer of test raster"}  # finished and put there
    assert writer.held_bytes == 0 and writer.blocked_s > 0.3


def test_a_failure_in_the_writers_finish_is_raised_in_the_main_thread_and_lets_its_bytes_go():
    writer = PieceWriter(lambda window, data: None, torch.device("cpu"))

    def broken(sums: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("finish failed")

    writer.submit_unfinished(torch.zeros((1, 8, 8)), broken, [(Window(0, 0, 8, 8), (slice(0, 8), slice(0, 8)))])
    with pytest.raises(RuntimeError, match="finish failed"):
        writer.drain()
    assert writer.held_bytes == 0
    with pytest.raises(RuntimeError, match="finish failed"):  # it stays: nothing more is written
        writer.submit_unfinished(torch.zeros((1, 8, 8)), doubled, [])
    writer.stop()
