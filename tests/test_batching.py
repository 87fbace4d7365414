import pytest

from rasterscale.runtime.batching import batch_sizes, per_device_batch, scaled_lr


@pytest.mark.parametrize(
    ("batch", "world", "per_device"),
    [(8, 1, 8), (8, 2, 4), (8, 3, 3), (16, 5, 4), (1, 4, 1), (10, 4, 3)],
)
def test_per_device_batch_is_ceil_of_global_over_world(batch, world, per_device):
    assert per_device_batch(batch, world) == per_device


def test_effective_batch_never_below_request_and_lr_follows_it():
    plan = batch_sizes(batch_size=10, world_size=4, base_lr=0.001, reference_batch=8, scaling="linear")
    assert plan.per_device_batch == 3
    assert plan.effective_batch == 12
    assert plan.lr == pytest.approx(0.001 * 12 / 8)
    assert "effective_batch=12" in plan.describe() and "per_device_batch=3" in plan.describe()


def test_same_global_batch_same_lr_across_world_sizes():
    lrs = {w: batch_sizes(16, w, 0.002, 16, "linear").lr for w in (1, 2, 4, 8)}
    assert set(lrs.values()) == {0.002}


def test_no_scaling_keeps_lr():
    assert scaled_lr(0.01, 64, 8, "none") == 0.01
    with pytest.raises(ValueError):
        scaled_lr(0.01, 64, 8, "sqrt")
    with pytest.raises(ValueError):
        per_device_batch(0, 2)
