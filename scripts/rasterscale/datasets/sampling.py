"""Which training samples a rank takes, in which order, and how each is flipped: a function of the seed, the epoch
and the sample alone, so that a run resumed within an epoch takes the rest of that epoch's samples, flipped as the
uninterrupted run flipped them. (Lightning restarts a resumed epoch's sampler from its start, and a dataloader
worker's random numbers start afresh with the run: the resumed run trained on other batches.)

- :class:`EpochSampler`: the rank's share of each epoch's permutation, as torch's ``DistributedSampler`` makes it
  (seed + epoch, padded to a multiple of the world size), given as sample keys ``epoch * n + index``;
  ``resume_at`` skips the batches that the interrupted run took of its epoch.
- :class:`KeyedSamples`: the scenes' training samples as one dataset: key -> sample ``index`` of its scene,
  flipped by :func:`flips_of` (seed, epoch, index).

The number of batches an interrupted run took is saved with its resume checkpoint (``checkpoints``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch.utils.data import ConcatDataset, Dataset, DistributedSampler


@dataclass(frozen=True)
class Flips:
    """A sample's augmentation: flipped left-right, flipped top-bottom."""

    horizontal: bool = False
    vertical: bool = False


NO_FLIPS = Flips()


def flips_of(seed: int, epoch: int, index: int) -> Flips:
    """The flips of sample ``index`` in ``epoch``: each with probability 1/2, the same in every run."""
    draws = np.random.default_rng([seed, epoch, index]).random(2)
    return Flips(bool(draws[0] < 0.5), bool(draws[1] < 0.5))


class FlippableSamples(Protocol):
    """A scene's training samples (a task's dataset): ``sample(index, flips)``, the sample flipped."""

    def __len__(self) -> int: ...

    def sample(self, index: int, flips: Flips) -> Any: ...


class KeyedSamples(Dataset):
    """The training samples of every scene as one dataset, taken by key (``epoch * len(self) + index``, what
    :class:`EpochSampler` yields): the sample ``index`` (scenes one after the other) with its epoch's flips."""

    def __init__(self, datasets: Sequence[FlippableSamples], seed: int) -> None:
        self.datasets = list(datasets)
        self.ends = ConcatDataset(self.datasets).cumulative_sizes  # type: ignore[arg-type]
        self.seed = seed

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, key: int) -> Any:
        epoch, index = divmod(int(key), len(self))
        scene = bisect.bisect_right(self.ends, index)
        local = index - (self.ends[scene - 1] if scene else 0)
        return self.datasets[scene].sample(local, flips_of(self.seed, epoch, index))


class EpochSampler(DistributedSampler):
    """This rank's keys of each epoch (shuffled by seed and epoch, as ``DistributedSampler``; Lightning sets the
    epoch). In the epoch given to :meth:`resume_at`, the batches the interrupted run already took are skipped;
    the length stays the epoch's, as Lightning counts a resumed epoch's batches from where it stopped."""

    def __init__(self, samples: KeyedSamples, world_size: int, rank: int, seed: int, batch_size: int) -> None:
        super().__init__(samples, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.batch_size = batch_size
        self.resumed: tuple[int, int] | None = None  # (epoch, batches taken)

    def resume_at(self, epoch: int, batches: int) -> None:
        self.resumed = (epoch, batches)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self.resumed is not None and self.resumed[0] == self.epoch:
            indices = indices[self.resumed[1] * self.batch_size :]
        offset = self.epoch * len(self.dataset)  # type: ignore[arg-type]
        return iter([offset + index for index in indices])
