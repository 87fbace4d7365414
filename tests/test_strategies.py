"""Dataloader strategies (window, single, batch) give the same detections; the fast path keeps the outputs."""

import copy
import os

import numpy as np
import pandas as pd
import pytest
import rasterio
import torch
from affine import Affine
from rasterio.env import get_gdal_config, set_gdal_config

from prediction import PredictScene, predict_rank_file
from rasterscale.datasets.tiles import (
    READ_CACHE,
    RasterHandle,
    RegionDataset,
    WindowDataset,
    limit_read_cache,
    load_region,
    loader_workers,
    prediction_dataset,
    read_cache_bytes,
    tiles_window,
    to_model_input,
)
from rasterscale.grid.manifest import build_manifest, tiles_from_frame
from rasterscale.grid.tile import Tile
from rasterscale.jobs.rankfiles import read_tile_ids
from rasterscale.raster.imagery import ImageSpec
from rasterscale.runtime.cores import auto_workers, prefetch_factor, rank_cores, rank_workers
from rasterscale.runtime.fastpath import fuse_conv_bn
from rasterscale.runtime.ranks import cpu_threads_per_rank
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


@pytest.fixture
def read_cache():
    """The process's read cache, as it was again after the test."""
    megabytes, configured = READ_CACHE.megabytes, get_gdal_config("GDAL_CACHEMAX")
    yield READ_CACHE
    READ_CACHE.megabytes = megabytes
    set_gdal_config("GDAL_CACHEMAX", configured)


def test_read_cache_is_bounded_in_bytes(read_cache):
    limit_read_cache(48)
    assert get_gdal_config("GDAL_CACHEMAX") == 48 * 2**20  # set at run time, GDAL takes bytes


def test_read_cache_grows_with_the_bytes_of_a_cached_pixel():
    assert read_cache_bytes(16) == read_cache_bytes(16, 1) == 16 * 2**20  # RGB uint8; never less
    assert read_cache_bytes(16, 26) == 16 * 2**20 * 26 // 3  # 13 uint16 bands: 139 MB
    for pixel_bytes in (3, 4, 26, 52):  # a row of 21 blocks of 512 px fits at any band count
        assert 21 * 512 * 512 * pixel_bytes <= read_cache_bytes(16, pixel_bytes)


def write_bands(path, count: int, dtype: str, interleave: str):
    profile = {"driver": "GTiff", "width": 64, "height": 64, "count": count, "dtype": dtype, "interleave": interleave}
    profile |= {"crs": "EPSG:32617", "transform": Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)}
    with rasterio.open(path, "w", **profile, tiled=True, blockxsize=32, blockysize=32) as dst:
        dst.write(np.ones((count, 64, 64), dtype=dtype))
    return path


@pytest.mark.parametrize(
    ("count", "dtype", "interleave", "pixel_bytes"),
    [
        (13, "uint16", "pixel", 26),  # GDAL decodes and caches every band of a block, even for 3 bands read
        (13, "uint16", "band", 6),  # only the 3 bands read
        (3, "uint8", "pixel", 3),
    ],
)
def test_a_raster_opened_to_read_tiles_sizes_the_read_cache_for_its_pixels(
    tmp_path, read_cache, count, dtype, interleave, pixel_bytes
):
    path = write_bands(tmp_path / "bands.tif", count, dtype, interleave)
    spec = ImageSpec(bands=(1, 2, 3), raw=dtype != "uint8")
    limit_read_cache(16)
    handle = RasterHandle(path, spec)
    assert get_gdal_config("GDAL_CACHEMAX") == 16 * 2**20  # until the raster is opened
    handle.read_pixels(Tile(0, 0, 0, 32, 32))
    assert get_gdal_config("GDAL_CACHEMAX") == read_cache_bytes(16, pixel_bytes)
    limit_read_cache(16)
    handle.read_pixels(Tile(1, 32, 0, 32, 32))  # opened once per process: sized once
    assert get_gdal_config("GDAL_CACHEMAX") == 16 * 2**20


def test_only_a_prediction_rank_bounds_the_read_cache(tmp_path, read_cache):
    read_cache.megabytes = None
    set_gdal_config("GDAL_CACHEMAX", 123 * 2**20)
    path = write_bands(tmp_path / "bands.tif", 13, "uint16", "pixel")
    RasterHandle(path, ImageSpec(bands=(1, 2, 3), raw=True)).read_pixels(Tile(0, 0, 0, 32, 32))
    assert get_gdal_config("GDAL_CACHEMAX") == 123 * 2**20  # training's reads leave GDAL's as it is


def test_only_the_window_strategy_reads_in_worker_processes():
    assert [loader_workers(s, 3) for s in STRATEGIES] == [3, 0, 0]
    with pytest.raises(ValueError, match="unknown dataloader strategy"):
        prediction_dataset("tiles", "x.tif", [], RGB)


SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_CPUS_PER_TASK": "6"}


def test_a_rank_has_its_srun_cpus_per_task_or_its_share_of_the_affinity():
    assert rank_cores(4, SRUN_TASK, cores=64) == 6  # Slurm does not bind tasks: the affinity is the node's
    assert rank_cores(4, SRUN_TASK, cores=6) == 6  # bound to its own cores, which are not shared again
    assert rank_cores(4, SRUN_TASK, cores=4) == 4  # never more than it may run on
    assert rank_cores(4, {"SLURM_CPUS_PER_TASK": "6"}, cores=16) == 4  # the batch script's variable: not a task
    assert rank_cores(4, {**SRUN_TASK, "SLURM_CPUS_PER_TASK": ""}, cores=16) == 4
    assert rank_cores(2, {}, cores=16) == 8 and rank_cores(4, {}, cores=2) == 1


def test_workers_come_from_the_rank_cores_unless_the_config_sets_them(monkeypatch):
    assert [auto_workers(cores, "gpu") for cores in (1, 2, 16)] == [0, 1, 15]  # the rank's own process keeps one
    assert [auto_workers(cores, "cpu") for cores in (1, 2, 3, 16)] == [0, 0, 1, 1]  # the model's threads: the rest
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    for name in SRUN_TASK:
        monkeypatch.delenv(name, raising=False)
    assert rank_workers(None, "gpu", 2) == 7 and cpu_threads_per_rank(2) == 8
    assert rank_workers(0, "gpu", 2) == 0 and rank_workers(3, "cpu", 2) == 3  # set: as set
    for name, value in SRUN_TASK.items():
        monkeypatch.setenv(name, value)
    assert rank_workers(None, "gpu", 2) == 5 and cpu_threads_per_rank(2) == 6


def test_workers_keep_batches_queued_ahead_of_the_model():
    assert prefetch_factor(0) is None  # DataLoader takes none without workers
    assert [prefetch_factor(workers) for workers in (1, 2, 3, 15)] == [4, 2, 2, 2]


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
