"""Batch-size and learning-rate arithmetic under data parallelism.

``train.batch_size`` is the *effective* (global) batch: what one optimizer step sees across all ranks. Each
device gets ``ceil(batch_size / world_size)`` (lightning-pose's rule), so the effective batch is never smaller
than asked. With ``lr_scaling: linear`` the learning rate follows the effective batch (Goyal et al., 2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizes:
    world_size: int
    requested_batch: int
    per_device_batch: int
    effective_batch: int
    base_lr: float
    reference_batch: int
    lr_scaling: str
    lr: float

    def describe(self) -> str:
        return (
            f"world_size={self.world_size} batch_size(requested, global)={self.requested_batch} "
            f"per_device_batch={self.per_device_batch} effective_batch={self.effective_batch} "
            f"lr={self.lr:.6g} (base {self.base_lr:g} at batch {self.reference_batch}, scaling={self.lr_scaling})"
        )


def per_device_batch(batch_size: int, world_size: int) -> int:
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch_size ({batch_size}) and world_size ({world_size}) must be >= 1")
    return math.ceil(batch_size / world_size)


def effective_batch(batch_size: int, world_size: int) -> int:
    """Images one optimizer step sees across all ranks: the per-device batch on every rank."""
    return per_device_batch(batch_size, world_size) * world_size


def scaled_lr(base_lr: float, effective_batch: int, reference_batch: int, scaling: str) -> float:
    if scaling == "none":
        return base_lr
    if scaling == "linear":
        return base_lr * effective_batch / reference_batch
    raise ValueError(f"unknown lr_scaling '{scaling}' (linear or none)")


def batch_sizes(batch_size: int, world_size: int, base_lr: float, reference_batch: int, scaling: str) -> BatchSizes:
    effective = effective_batch(batch_size, world_size)
    return BatchSizes(
        world_size=world_size,
        requested_batch=batch_size,
        per_device_batch=per_device_batch(batch_size, world_size),
        effective_batch=effective,
        base_lr=base_lr,
        reference_batch=reference_batch,
        lr_scaling=scaling,
        lr=scaled_lr(base_lr, effective, reference_batch, scaling),
    )
