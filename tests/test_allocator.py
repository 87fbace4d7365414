"""A rank keeps the host memory it frees for its next batches (rasterscale.runtime.allocator)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# A batch's worth of tensors alive at once (8 of 8 MiB), then all freed, 20 times: glibc gives the top of its heap
# back and faults it in again, page by page, the next time; kept, the pages are reused.
BATCHES = 20
CODE = f"""
import resource, sys
sys.path.insert(0, {str(REPO / "scripts")!r})
import numpy as np
from rasterscale.runtime.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def batch():
    held = [np.ones(8 * 2**20, np.uint8) for _ in range(8)]
    del held
batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({BATCHES}):
    batch()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize() // 2**20)
"""


def faulted_mb(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, check=True).stdout
    kept, megabytes = out.split()
    return kept, int(megabytes)


def test_freed_memory_is_reused_by_the_next_batches_instead_of_faulted_in_again():
    # armed: without it, the batches fault in more than two batches' worth (64 MiB each) again
    assert faulted_mb("default")[1] > 2 * 64
    kept, megabytes = faulted_mb("keep")
    assert kept == "True"
    assert megabytes < 8, f"{megabytes} MiB faulted in again over {BATCHES} batches"
