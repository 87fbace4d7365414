"""Any segmentation-models-pytorch architecture and encoder for the dense tasks (model.architecture, model.encoder),
and encoder weights only from a local file (model.encoder_weights): a TorchGeo-style timm state dict starts the
encoder it fits, and what cannot work stops the plan (what `snakemake -n` runs) in one line."""

from __future__ import annotations

from pathlib import Path

import geopandas as gpd
import pytest
import shapely
import timm
import torch

from conftest import UTM17N, write_raster
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.settings import settings_of
from rasterscale.tasks.encoders import SMP_ENCODERS, encoder_name
from rasterscale.tasks.regression.model import build_regressor, load_regressor, save_regressor
from rasterscale.tasks.regression.modelfiles import RegressorConfig
from rasterscale.tasks.segmentation.model import build_segmenter
from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig, segmenter_of_config
from rasterscale.tasks.segmentation.task import SegmentationTask
from rasterscale.workflow.checks import build_plan

SENTINEL2 = 13  # TorchGeo's Sentinel-2 weights take 13 bands


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A 13-band and a 4-band scene with a crown each, and a 13-band TorchGeo-style timm ResNet-50 state dict (the
    state dict of ``timm.create_model("resnet50", in_chans=13)``, its classifier ``fc.*`` included)."""
    folder = tmp_path_factory.mktemp("encoders")
    write_raster(folder / "s2.tif", 64, 64, count=SENTINEL2)
    write_raster(folder / "rgbn.tif", 64, 64, count=4)
    crown = shapely.box(404001, 3284994, 404003, 3284996)
    gpd.GeoDataFrame({"label": ["tree"]}, geometry=[crown], crs=UTM17N).to_file(folder / "crowns.gpkg")
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet50", in_chans=SENTINEL2, pretrained=False).state_dict(), folder / "s2.pth")
    return folder


def config_of(data: Path, scene: str = "s2.tif", bands: int = SENTINEL2, **model: object) -> dict:
    """A segmentation config training on ``scene`` (its ``bands``) with the given model keys."""
    return {
        "task": "segmentation",
        "scenes": {
            "train": {
                "path": str(data / scene),
                "annotations": str(data / "crowns.gpkg"),
                "bands": list(range(1, bands + 1)),
            }
        },
        "tiling": {"patch_size": 64, "overlap": 16},
        "model": {"labels": ["background", "tree"], **model},
        "train": {"scenes": ["train"], "devices": 1, "validation_fraction": 0},
    }


def test_the_encoders_are_smps_own_or_timms():
    import segmentation_models_pytorch as smp

    assert tuple(smp.encoders.get_encoder_names()) == SMP_ENCODERS  # of the pinned 0.6.0
    assert encoder_name("resnet50") == "resnet50"  # smp's (torchvision-style keys)
    assert encoder_name("tu-resnet50") == "tu-resnet50"  # timm's
    assert encoder_name("convnext_atto") == "tu-convnext_atto"  # a bare timm name that is not smp's
    with pytest.raises(ConfigError) as raised:
        encoder_name("foo")
    assert str(raised.value) == "model.encoder: 'foo' is neither a segmentation-models-pytorch nor a timm encoder"


@pytest.mark.parametrize("encoder", ["resnet50", "tu-resnet50"])
def test_a_torchgeo_style_timm_state_dict_starts_the_encoder_it_fits(data, encoder):
    """Training starts a 13-band segmenter's encoder from the file: its features are timm's model's, stage by stage;
    the classifier is left out and said so."""
    config = settings_of(validate_config(config_of(data, encoder=encoder, encoder_weights=str(data / "s2.pth"))))
    cfg = segmenter_of_config(config)
    assert (cfg.encoder, cfg.input.count) == (encoder, SENTINEL2)
    task = SegmentationTask()
    model = task.build_model(cfg)
    said = task.initial_weights(model, cfg, config)
    assert said.startswith(f"encoder {encoder} from {data / 's2.pth'}") and "left out (fc.weight, fc.bias)" in said
    reference = timm.create_model("resnet50", in_chans=SENTINEL2, pretrained=False)
    reference.load_state_dict(torch.load(data / "s2.pth"))
    images = torch.rand(2, SENTINEL2, 64, 64)
    with torch.inference_mode():
        features = model.get_submodule("net.encoder").eval()(images)[1:]
        expected = reference.eval().forward_intermediates(images, intermediates_only=True)
    assert len(features) == len(expected) == 5
    for found, wanted in zip(features, expected, strict=True):
        torch.testing.assert_close(found, wanted)


def test_weights_of_another_encoder_fail_when_training_starts_in_one_line(data):
    config = settings_of(validate_config(config_of(data, encoder="resnet18", encoder_weights=str(data / "s2.pth"))))
    cfg = segmenter_of_config(config)
    with pytest.raises(InputError, match=rf"^{data / 's2.pth'}: .* tensors differ in shape from the encoder's, e\.g\."):
        SegmentationTask().initial_weights(build_segmenter(cfg), cfg, config)


def test_encoder_keys_that_cannot_work_stop_the_plan_in_one_line(data, tmp_path):
    weights = data / "s2.pth"
    cases = [
        (
            config_of(data, "rgbn.tif", 4, encoder="resnet50", encoder_weights=str(weights)),
            InputError,
            f"{weights}: the encoder weights take 13 bands (their first convolution, conv1.weight) but the model's "
            "input has 4 bands (model.encoder_weights)",
        ),
        (
            config_of(data, encoder="resnet50", encoder_weights="imagenet"),
            ConfigError,
            "config: key 'model.encoder_weights' is 'imagenet', a name of pretrained weights, but rasterscale never "
            "downloads: give a local file (an encoder state dict saved with torch.save, e.g. TorchGeo's or timm's)",
        ),
        (
            config_of(data, encoder_weights=str(data / "missing.pth")),
            InputError,
            f"{data / 'missing.pth'}: encoder weights file not found (model.encoder_weights)",
        ),
        (
            config_of(data, encoder_weights=str(data / "crowns.gpkg")),
            InputError,
            f"{data / 'crowns.gpkg'}: not a torch-saved state dict (model.encoder_weights)",
        ),
        (
            config_of(data, encoder="foo"),
            ConfigError,
            "model.encoder: 'foo' is neither a segmentation-models-pytorch nor a timm encoder",
        ),
        (
            config_of(data, architecture="unetplusplus", encoder="mit_b0"),
            ConfigError,
            "config: key 'model.encoder' is mit_b0, which segmentation-models-pytorch's unetplusplus does not take "
            "(mit_b* encoders): pick another encoder or model.architecture",
        ),
        (
            config_of(data, backbone="resnet34"),
            ConfigError,
            "config: key 'model.backbone' is for detection and instances; segmentation's network takes "
            "model.encoder (e.g. encoder: resnet34)",
        ),
    ]
    for config, error, message in cases:
        with pytest.raises(error) as raised:
            build_plan(config, tmp_path)
        assert str(raised.value) == message
    plan = build_plan(config_of(data, encoder="resnet50", encoder_weights=str(weights)), tmp_path)
    assert plan.model_input.count == SENTINEL2  # the 13-band file fits the 13-band scene


def test_dense_files_record_their_network_and_old_files_still_load(tmp_path):
    """A regressor on another architecture keeps its fp32 linear head and its output scaling, and its file records
    architecture and encoder; a file of before model.encoder (its encoder recorded as backbone) still reads."""
    cfg = RegressorConfig(patch_size=64, architecture="fpn", encoder="tu-resnet18")
    model = build_regressor(cfg).eval()
    model.set_target_scale([10.0], [2.0])
    images = torch.rand(1, 3, 64, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        values = model(images)
    assert values.dtype == torch.float32 and values.shape == (1, 1, 64, 64)
    saved = save_regressor(model, cfg, tmp_path / "fpn.pt")
    loaded, read, _ = load_regressor(tmp_path / "fpn.pt")
    assert (read.architecture, read.encoder, read.decoder_channels, read.target_mean) == (
        "fpn",
        "tu-resnet18",
        None,
        (10.0,),
    )
    with torch.inference_mode():
        torch.testing.assert_close(loaded.eval()(images), model(images))
    assert saved == read
    old = {k: v for k, v in RegressorConfig(patch_size=64).to_dict().items() if k not in ("encoder", "architecture")}
    assert RegressorConfig.from_dict({**old, "backbone": "resnet34"}) == RegressorConfig(
        patch_size=64, encoder="resnet34"
    )
    old = {k: v for k, v in SegmenterConfig(("a", "b")).to_dict().items() if k != "encoder"}
    assert SegmenterConfig.from_dict({**old, "backbone": "resnet34"}).encoder == "resnet34"
