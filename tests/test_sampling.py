"""Training samples by seed, epoch and index (rasterscale.datasets.sampling): each rank's share of every epoch, the
rest of an epoch after a resume, and flips that do not depend on who draws them."""

from __future__ import annotations

import pytest

from rasterscale.datasets.sampling import EpochSampler, Flips, KeyedSamples, flips_of


class Scene:
    """Samples that say what they are: (scene name, index, flips)."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int, flips: Flips) -> tuple[str, int, Flips]:
        assert 0 <= index < self.size
        return self.name, index, flips


def samples() -> KeyedSamples:
    return KeyedSamples([Scene("a", 7), Scene("b", 0), Scene("c", 6)], seed=3)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ranks_share_every_epoch_and_each_sample_comes_once_in_it(world):
    data = samples()
    for epoch in (0, 1, 5):
        taken = []
        for rank in range(world):
            sampler = EpochSampler(data, world, rank, seed=3, batch_size=2)
            sampler.set_epoch(epoch)
            keys = list(sampler)
            assert len(keys) == len(sampler) == -(-13 // world)  # padded as DistributedSampler pads
            assert all(divmod(key, 13)[0] == epoch for key in keys)
            taken += [data[key][:2] for key in keys]
        expected = [("a", i) for i in range(7)] + [("c", i) for i in range(6)]
        assert sorted(set(taken)) == sorted(expected) and len(taken) - len(expected) < world


def test_a_resumed_epoch_goes_on_after_the_batches_taken_and_the_next_epochs_are_whole():
    data = samples()
    full = EpochSampler(data, 2, 1, seed=3, batch_size=2)
    resumed = EpochSampler(data, 2, 1, seed=3, batch_size=2)
    resumed.resume_at(epoch=4, batches=2)
    for epoch in (3, 4, 5):
        full.set_epoch(epoch)
        resumed.set_epoch(epoch)
        expected = list(full)[4:] if epoch == 4 else list(full)
        assert list(resumed) == expected and len(resumed) == len(full)
    full.set_epoch(0)
    assert list(full) != list(EpochSampler(data, 2, 1, seed=4, batch_size=2))  # another seed, another order


def test_flips_depend_on_seed_epoch_and_sample_only():
    draws = [flips_of(3, epoch, index) for epoch in range(20) for index in range(20)]
    assert draws == [flips_of(3, epoch, index) for epoch in range(20) for index in range(20)]
    for attribute in ("horizontal", "vertical"):
        share = sum(getattr(flips, attribute) for flips in draws) / len(draws)
        assert 0.4 < share < 0.6, (attribute, share)
    assert [flips_of(3, 0, i) for i in range(20)] != [flips_of(3, 1, i) for i in range(20)]
    assert [flips_of(3, 0, i) for i in range(20)] != [flips_of(4, 0, i) for i in range(20)]
    data = samples()
    assert data[13 * 2 + 8] == ("c", 1, flips_of(3, 2, 8))  # key: epoch 2, sample 8 = scene c's second
    assert data[3] == ("a", 3, flips_of(3, 0, 3))
