"""What the bench ran on: the CPU, its flags that decide bf16, cores, torch, what oneDNN says, the precision
``auto`` picks there (:mod:`rasterscale.runtime.precision`, the one source of these facts) and the GPU, if any.

:func:`describe` and :func:`header` work on values, so they are testable for any machine; :func:`machine`
measures this one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rasterscale.runtime.precision import Capability, choose, cpu_info, probe

# the x86 flags that decide how fast bf16 is: AVX2 (fp32 only), AVX-512 (bf16 emulated), AVX512-BF16, AMX
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def describe(
    cpu: Capability, flags: frozenset[str], cores: int, torch_version: str, gpu: Capability | None = None
) -> dict[str, Any]:
    """The bench's machine record (results JSON) from a CPU's capability and flags, and a GPU's capability."""
    return {
        "cpu": cpu.name,
        "cores": cores,
        "flags": {flag: flag in flags for flag in REPORTED_FLAGS},
        "bf16_native": cpu.bf16,
        "onednn": cpu.detail,
        "auto": choose(cpu),
        "torch": torch_version,
        "gpu": gpu.name if gpu is not None else None,
        "gpu_detail": gpu.detail if gpu is not None else None,
        "gpu_auto": choose(gpu) if gpu is not None else None,
    }


def machine() -> dict[str, Any]:
    """This machine's record: its CPU (the bench's own measurements and prediction jobs run there) and GPU."""
    gpu = probe("gpu") if torch.cuda.is_available() else None
    return describe(probe("cpu"), cpu_info()[1], len(os.sched_getaffinity(0)), torch.__version__, gpu)


def header(m: dict[str, Any], wall_s: float) -> list[str]:
    """The table's first lines: the machine and what ``auto`` picks on it."""
    flags = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in m["flags"].items())
    gpu = (
        f"{m['gpu']} ({m['gpu_detail']}, auto picks {m['gpu_auto']}; the bench runs on the CPU)" if m["gpu"] else "none"
    )
    return [
        f"rasterscale bench: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, GPU {gpu}; {wall_s:.0f} s",
        f"CPU flags: {flags}; {m['onednn']}: bf16 {'native' if m['bf16_native'] else 'emulated'},"
        f" precision auto picks {m['auto']} on this CPU",
    ]
