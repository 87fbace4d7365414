"""A rank's host memory: blocks it frees kept for its next batch, not handed back to the kernel and mapped again.

A rank allocates the same tensors batch after batch: a batch's float input, the model's outputs, the post-processed
results, tens of MB each. glibc's malloc serves a block above its mmap threshold (128 KiB at first, rising by
itself to the size of the largest such block freed, at most 32 MiB) with a fresh mapping, and gives the top of its
heap back to the kernel once twice that is free. So each batch's tensors are mapped anew and faulted in page by
page, each page zeroed by the kernel first: on a null model's segmentation job (6144² px, 256 px tiles, batch 32,
one CPU rank of 2 cores) the rank's process took 571,000 page faults instead of 262,000, and predicted 446 tiles/s
instead of 541.

:func:`keep_freed_memory` fixes the threshold at its largest and stops the trimming (``mallopt``), in the rank's
process and the dataloader workers it forks: its resident memory stays at its peak, which the first batches reach
anyway. Blocks above 32 MiB (a batch of larger tiles) are still mapped each time. Elsewhere than glibc (no
``mallopt``) nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # free memory at the heap's top kept up to this (an int): never trimmed in practice


def keep_freed_memory() -> bool:
    """Keep freed blocks in this process's heap for reuse (module docstring); whether the allocator took it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
