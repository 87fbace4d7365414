"""Any band count: a model's input bands (names, roles, normalization), raw and scaled tiles of N bands, the first
convolution adapted from an RGB start with its RGB filters unchanged, and the normalization stored in the model
file and reused at prediction."""

from __future__ import annotations

import numpy as np
import pytest
import rasterio
import torch

from conftest import write_raster
from rasterscale.config.schema import validate_config
from rasterscale.datasets.tiles import RasterHandle, load_region, pixels_to_tensor
from rasterscale.grid.tile import Tile
from rasterscale.raster.bands import (
    IMAGE_MEAN,
    OTHER_MEAN,
    BandStatistics,
    InputBands,
    default_band_names,
    differs_wildly,
    input_of_keys,
    pooled_statistics,
    rgb_roles,
    scaled_input,
)
from rasterscale.raster.imagery import resolve_spec
from rasterscale.settings import settings_of
from rasterscale.tasks.detection.model import build_detector, init_from_model_file, save_detector
from rasterscale.tasks.detection.modelfiles import DetectorConfig, read_header
from rasterscale.tasks.inputlayer import adapt_first_conv
from rasterscale.tasks.modelinput import configured_input
from rasterscale.tasks.segmentation.model import build_segmenter, load_segmenter, save_segmenter
from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig, segmenter_of_config
from rasterscale.tasks.segmentation.task import SegmentationTask
from rasterscale.workflow.checks import build_plan

RGBN = ("red", "green", "blue", "nir")


def test_band_names_roles_and_the_default_input():
    assert default_band_names(3) == ("red", "green", "blue")
    assert default_band_names(5) == ("red", "green", "blue", "band4", "band5")
    assert default_band_names(1) == ("band1",)
    assert rgb_roles(["nir", "Red", "green", "blue"]) == {"red": 1, "green": 2, "blue": 3}
    assert rgb_roles([f"B{k:02d}" for k in range(1, 13)]) == {"blue": 1, "green": 2, "red": 3}  # Sentinel-2
    assert InputBands().is_default and InputBands.from_dict(None) == InputBands()  # a file that records none
    rgbn = scaled_input(RGBN)
    assert rgbn.mean[:3] == IMAGE_MEAN and rgbn.mean[3] == OTHER_MEAN and not rgbn.raw
    assert InputBands.from_dict(rgbn.to_dict()) == rgbn
    with pytest.raises(ValueError, match=r"std of band green is 0\.0: it must be positive"):
        InputBands(RGBN[:3], (1.0, 1.0, 1.0), (1.0, 0.0, 1.0), raw=True)
    with pytest.raises(ValueError, match="band names repeat"):
        InputBands(("red", "Red", "blue"))
    given = input_of_keys(RGBN, {"mean": [90, 80, 70, 120], "std": [30, 25, 20, 40]})  # 4 bands: was refused
    assert given == InputBands(RGBN, (90.0, 80.0, 70.0, 120.0), (30.0, 25.0, 20.0, 40.0), raw=True)


def test_pooled_statistics_are_those_of_the_scenes_pixels_together():
    rng = np.random.default_rng(0)
    a, b = rng.normal(100, 10, (2, 5000)), rng.normal(300, 40, (2, 2000))
    scenes = [BandStatistics(tuple(x.mean(1)), tuple(x.std(1)), x.shape[1]) for x in (a, b)]
    mean, std = pooled_statistics(scenes)
    both = np.concatenate([a, b], axis=1)
    np.testing.assert_allclose(mean, both.mean(1), rtol=1e-9)
    np.testing.assert_allclose(std, both.std(1), rtol=1e-9)
    model = InputBands(("a", "b"), scenes[0].mean, scenes[0].std, raw=True)
    alike = rng.normal(104, 12, (2, 3000))
    assert differs_wildly(BandStatistics(tuple(alike.mean(1)), tuple(alike.std(1)), 3000), model) is None
    sixteen_bit = BandStatistics(tuple(a.mean(1) * 16), tuple(a.std(1) * 16), 100)  # another bit depth
    assert (differs_wildly(sixteen_bit, model) or "").startswith("band a: the scene's mean 1599, std 159.3 against")


def test_n_band_tiles_scaled_and_raw(tmp_path):
    """Four uint16 bands: scaled to uint8 per band, or raw float32 values with masked pixels at the scene's mean."""
    data = np.random.default_rng(1).integers(100, 4000, size=(4, 96, 128)).astype(np.uint16)
    data[:, :8, :8] = 0  # nodata in every band
    path = write_raster(tmp_path / "rgbn.tif", 128, 96, count=4, data=data, nodata=0)
    tile = Tile(0, 0, 0, 64, 64)
    scaled = resolve_spec(path, [1, 2, 3, 4], {"min": 0, "max": 4095}, "scenes.a")
    pixels = RasterHandle(path, scaled).read_pixels(tile)
    assert pixels.shape == (4, 64, 64) and pixels.dtype == np.uint8
    expected = np.rint(data[:, :64, :64].astype(np.float32) * 255 / 4095).astype(np.uint8)
    np.testing.assert_array_equal(pixels[:, 8:, 8:], expected[:, 8:, 8:])
    raw = resolve_spec(path, [4, 1], None, "scenes.a", raw=True)  # any bands, any order
    assert raw.statistics is not None and raw.statistics.count == 128 * 96 - 64
    valid = data[[3, 0]][:, data[0] > 0]
    np.testing.assert_allclose(raw.statistics.mean, valid.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(raw.statistics.std, valid.std(axis=1), rtol=1e-6)
    values = RasterHandle(path, raw).read_pixels(tile)
    assert values.dtype == np.float32 and values.shape == (2, 64, 64)
    np.testing.assert_array_equal(values[:, 8:, 8:], data[[3, 0], 8:64, 8:64])
    np.testing.assert_allclose(values[:, 0, 0], raw.statistics.mean, rtol=1e-6)  # masked: the band's mean
    assert torch.equal(pixels_to_tensor(values), torch.from_numpy(values))  # raw values reach the model as they are
    region = load_region(path, rasterio.windows.Window(0, 0, 64, 64), raw)
    assert region.dtype == torch.float32 and torch.equal(region, torch.from_numpy(values))


def test_the_first_convolution_keeps_the_rgb_filters_for_the_bands_in_those_roles():
    weight = torch.randn(8, 3, 7, 7)
    bands = InputBands(("nir", "red", "green", "blue", "swir"), (0.5,) * 5, (0.2,) * 5)
    adapted, text = adapt_first_conv(weight, bands)
    assert adapted.shape == (8, 5, 7, 7)
    for k, index in enumerate((1, 2, 3)):  # red, green, blue where the names put them
        assert torch.equal(adapted[:, index], weight[:, k])
    extra = weight.mean(dim=1) * 3 / 5
    assert torch.allclose(adapted[:, 0], extra) and torch.allclose(adapted[:, 4], extra)
    assert text == (
        "first convolution adapted from 3 to 5 bands: RGB filters kept (red -> band 2 (red), green -> band 3 (green), "
        "blue -> band 4 (blue)); nir, swir from the mean of the RGB filters x 3/5"
    )
    same, text = adapt_first_conv(weight, InputBands())
    assert same is weight and text == ""  # nothing done, nothing to log


def test_an_rgbn_detector_starts_from_an_rgb_model_file_with_its_rgb_filters(tmp_path):
    torch.manual_seed(0)
    rgb_cfg = DetectorConfig(backbone="resnet18", fpn_channels=64, patch_size=128)
    rgb = build_detector(rgb_cfg)
    save_detector(rgb, rgb_cfg, tmp_path / "rgb.pt")
    cfg = DetectorConfig(backbone="resnet18", fpn_channels=64, patch_size=128, input=scaled_input(RGBN))
    model = build_detector(cfg)
    assert model.backbone.body.conv1.in_channels == 4 and list(model.transform.image_mean) == list(cfg.input.mean)
    text = init_from_model_file(model, cfg, tmp_path / "rgb.pt")
    assert "first convolution adapted from 3 to 4 bands" in text and "nir from the mean" in text
    before, after = rgb.backbone.body.conv1.weight, model.backbone.body.conv1.weight
    assert torch.equal(after[:, :3], before) and torch.allclose(after[:, 3], before.mean(1) * 0.75)
    assert torch.equal(model.head.regression_head.bbox_reg.weight, rgb.head.regression_head.bbox_reg.weight)
    model.eval()
    with torch.inference_mode():
        out = model([torch.rand(4, 128, 128)])
    assert set(out[0]) == {"boxes", "scores", "labels"}
    save_detector(model, cfg, tmp_path / "rgbn.pt")
    assert read_header(tmp_path / "rgbn.pt").input == cfg.input  # recorded, read back without torch


def test_normalization_is_stored_in_the_model_file_and_reused_at_prediction(tmp_path):
    bands = InputBands(RGBN, (310.0, 420.0, 280.0, 2100.0), (90.0, 110.0, 70.0, 600.0), raw=True)
    cfg = SegmenterConfig(("background", "tree"), patch_size=64, input=bands)
    torch.manual_seed(1)
    model = build_segmenter(cfg).eval()
    save_segmenter(model, cfg, tmp_path / "seg.pt")
    loaded, loaded_cfg, _ = load_segmenter(tmp_path / "seg.pt")
    assert loaded_cfg.input == bands
    assert torch.equal(loaded.normalize.mean.flatten(), torch.tensor(bands.mean))
    tile = torch.rand(1, 4, 64, 64) * torch.tensor([600.0, 800.0, 500.0, 4000.0]).view(1, 4, 1, 1)
    with torch.inference_mode():
        assert torch.equal(loaded.eval()(tile), model(tile))
    config = settings_of(validate_config({"task": "segmentation", "model": {"file": str(tmp_path / "seg.pt")}}))
    assert segmenter_of_config(config).input == bands  # the dry run reads it from the header


def test_an_rgbn_segmenter_fine_tunes_from_an_rgb_one(tmp_path):
    torch.manual_seed(2)
    rgb_cfg = SegmenterConfig(("background", "tree"), patch_size=64)
    rgb = build_segmenter(rgb_cfg)
    save_segmenter(rgb, rgb_cfg, tmp_path / "rgb.pt")
    config = settings_of(
        validate_config(
            {
                "task": "segmentation",
                "scenes": {"a": {"path": "a.tif", "annotations": "a.gpkg", "bands": [1, 2, 3, 4], "normalize": "auto"}},
                "model": {"band_names": list(RGBN)},
                "train": {"scenes": ["a"], "init": str(tmp_path / "rgb.pt")},
            }
        )
    )
    assert configured_input(config) == InputBands(RGBN, (), (), raw=True)
    cfg = SegmenterConfig(("background", "tree"), patch_size=64, input=scaled_input(RGBN))
    model = build_segmenter(cfg)
    text = SegmentationTask().initial_weights(model, cfg, config)
    assert "first convolution adapted from 3 to 4 bands" in text
    before, after = rgb.net.encoder.conv1.weight, model.net.encoder.conv1.weight
    assert torch.equal(after[:, :3], before) and torch.allclose(after[:, 3], before.mean(1) * 0.75)


def test_a_scene_whose_statistics_differ_wildly_from_a_raw_models_gets_a_warning_at_dry_run(tmp_path):
    """Another bit depth (12-bit values for a model trained on 8-bit ones): the dry run warns with both values;
    a scene like the model's training scenes passes silently."""
    bands = InputBands(RGBN, (100.0, 110.0, 90.0, 120.0), (30.0, 30.0, 25.0, 40.0), raw=True)
    cfg = SegmenterConfig(("background", "tree"), patch_size=64, input=bands)
    save_segmenter(build_segmenter(cfg), cfg, tmp_path / "seg.pt")
    rng = np.random.default_rng(3)
    alike = rng.normal(105, 30, size=(4, 128, 128)).clip(1, 255).astype(np.uint16)
    write_raster(tmp_path / "alike.tif", 128, 128, count=4, data=alike)
    write_raster(tmp_path / "deeper.tif", 128, 128, count=4, data=alike * 16)
    for name, warned in (("alike", False), ("deeper", True)):
        config = {
            "task": "segmentation",
            "scenes": {name: {"path": str(tmp_path / f"{name}.tif"), "bands": [1, 2, 3, 4]}},
            "tiling": {"patch_size": 64, "overlap": 16},
            "model": {"file": str(tmp_path / "seg.pt")},
            "predict": {"scenes": [name]},
        }
        lines: list[str] = []
        build_plan(config, tmp_path / "run", warn=lines.append)
        found = [line for line in lines if "differ from what the model was trained on" in line]
        assert bool(found) == warned, lines
    assert found[0].startswith(f"{tmp_path / 'deeper.tif'}: scene deeper's pixels differ from what the model was")
    assert "band red: the scene's mean 1" in found[0] and "against the model's mean 100, std 30" in found[0]
