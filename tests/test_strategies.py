"""Dataloader strategies (window, single, batch) give the same detections; the fast path keeps the outputs."""

import copy

import pandas as pd
import pytest
import torch

from prediction import PredictScene, predict_rank_file
from rasterscale.datasets.tiles import (
    RegionDataset,
    WindowDataset,
    limit_read_cache,
    load_region,
    loader_workers,
    prediction_dataset,
    tiles_window,
    to_model_input,
)
from rasterscale.grid.manifest import build_manifest, tiles_from_frame
from rasterscale.grid.tile import Tile
from rasterscale.jobs.rankfiles import read_tile_ids
from rasterscale.raster.imagery import ImageSpec
from rasterscale.runtime.fastpath import fuse_conv_bn
from rasterscale.tasks.detection.model import DetectorConfig, build_detector
from rasterscale.tasks.detectors.model import prepare_for_inference

STRATEGIES = ["window", "single", "batch"]
RGB = ImageSpec()  # bands 1-3 of a uint8 raster without a mask


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return PredictScene.make(tmp_path_factory.mktemp("strategies"))


def test_every_strategy_gives_each_tile_the_same_pixels(scene):
    tiles = tiles_from_frame(build_manifest(scene.raster, scene.patch_size, scene.overlap))[3:9]
    window = [WindowDataset(scene.raster, tiles, RGB)[k] for k in range(len(tiles))]
    for strategy in ("single", "batch"):
        dataset = prediction_dataset(strategy, scene.raster, tiles, RGB)
        assert isinstance(dataset, RegionDataset)
        for (image, tile_id), (expected, expected_id) in zip(
            (dataset[k] for k in range(len(tiles))), window, strict=True
        ):
            assert tile_id == expected_id and image.dtype == torch.uint8
            assert torch.equal(image, expected)
            assert torch.equal(to_model_input(image.clone()), expected.float() / 255)


def test_region_is_the_bounding_window_of_the_rank_tiles_read_in_chunks(scene):
    tiles = [Tile(0, 100, 40, 64, 64), Tile(1, 150, 60, 64, 64)]
    window = tiles_window(tiles)
    assert (window.col_off, window.row_off, window.width, window.height) == (100, 40, 114, 84)
    whole = load_region(scene.raster, window, RGB)
    assert torch.equal(load_region(scene.raster, window, RGB, chunk_rows=7), whole)
    assert whole.shape == (3, 84, 114)


def test_read_cache_is_bounded_in_bytes():
    from rasterio.env import get_gdal_config

    limit_read_cache(48)
    assert get_gdal_config("GDAL_CACHEMAX") == 48 * 2**20  # set at run time, GDAL takes bytes
    limit_read_cache(64)


def test_only_the_window_strategy_reads_in_worker_processes():
    assert [loader_workers(s, 3) for s in STRATEGIES] == [3, 0, 0]
    with pytest.raises(ValueError, match="unknown dataloader strategy"):
        prediction_dataset("tiles", "x.tif", [], RGB)


def test_folding_batch_norms_and_channels_last_keep_the_outputs():
    torch.manual_seed(0)
    model = build_detector(DetectorConfig(backbone="resnet18", patch_size=128)).eval()
    # non-trivial statistics, as after training
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
    fast = prepare_for_inference(copy.deepcopy(model), channels_last=True)
    assert fuse_conv_bn(copy.deepcopy(model)) == 20  # resnet18: stem + 16 block convs + 3 shortcuts
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fast.modules())
    images = torch.rand(2, 3, 128, 128)
    with torch.inference_mode():
        plain, folded = model.backbone(images), fast.backbone(images)
    for name in plain:
        torch.testing.assert_close(folded[name], plain[name], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_window_single_and_batch_strategies_give_identical_detections(scene, tmp_path):
    frames = {}
    for strategy in STRATEGIES:
        path = predict_rank_file(scene, tmp_path / strategy, strategy=strategy)
        assert sorted(read_tile_ids(path.with_suffix("")).tolist()) == list(range(scene.tiles))
        frames[strategy] = pd.DataFrame(pd.read_parquet(path).drop(columns="geometry"))
    assert len(frames["window"]) > 100  # the untrained model at a low threshold: plenty of boxes to compare
    for strategy in ("single", "batch"):
        pd.testing.assert_frame_equal(frames[strategy], frames["window"])
