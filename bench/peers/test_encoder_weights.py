"""Encoder weights as TorchGeo publishes them start rasterscale's training and give TorchGeo's features.

TorchGeo's pretrained ResNets (``ResNet18_Weights.*``, ``ResNet50_Weights.SENTINEL2_ALL_MOCO``, ...) are state dicts
of ``timm.create_model("resnet18", in_chans=N)``, loaded by TorchGeo with ``torch.hub`` from their URL. Nothing can be
downloaded here, so the file is made the same way from a timm ResNet-18 of 4 bands (RGBN, as TorchGeo's NAIP
weights) with random weights, batch norm statistics included, and without ``fc.*``; TorchGeo loads it through its
own API from a ``file://`` URL (a ``WeightsEnum`` of its own, ``torch.hub``'s cache in a temporary folder):

- ``torchgeo.models.resnet18(weights=...)``: the timm model TorchGeo builds (``in_chans`` from the weights' meta);
- ``SemanticSegmentationTask(model="unet", backbone="resnet18", weights=..., in_channels=4)``: the U-Net whose
  encoder TorchGeo starts from the weights.

rasterscale, in its own environment, takes the file as ``model.encoder_weights`` of a segmentation config
(``model.encoder: resnet18``) and starts the network as training does (``bench/peers/rasterscale_encoder.py``); the
encoders' features on a batch (eval mode, every stage) must be TorchGeo's. A real training run through the workflow
(2 ranks, one step at a learning rate of 1e-9) then starts from the file: its log names it, and the trained model's
encoder holds its tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import timm
import torch
import yaml
from torchgeo.models import resnet18
from torchgeo.trainers import SemanticSegmentationTask
from torchvision.models._api import Weights, WeightsEnum

from conftest import RASTERSCALE_BIN, REPO, report

BANDS = ["red", "green", "blue", "nir"]


def timm_state_dict(bands: int) -> dict[str, torch.Tensor]:
    """A timm ResNet-18 of ``bands`` input bands with random weights and random batch norm statistics (so that eval
    mode depends on every tensor), without its classifier: what TorchGeo publishes for a sensor."""
    torch.manual_seed(5)
    model = timm.create_model("resnet18", in_chans=bands, pretrained=False)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.normal_(0, 0.1)
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return {k: v for k, v in model.state_dict().items() if not k.startswith("fc.")}


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("weights") / "resnet18_rgbn_random.pth"
    torch.save(timm_state_dict(len(BANDS)), path)
    return path


@pytest.fixture(scope="module")
def torchgeo_weights(weights_file: Path, tmp_path_factory: pytest.TempPathFactory) -> WeightsEnum:
    """The file as TorchGeo's weights enums name theirs: a URL, transforms and meta (``in_chans``, ``model``)."""
    torch.hub.set_dir(str(tmp_path_factory.mktemp("hub")))  # torch.hub copies the file into its cache

    class LocalResNet18Weights(WeightsEnum):  # type: ignore[misc]
        RGBN_RANDOM = Weights(
            url=weights_file.as_uri(),
            transforms=None,
            meta={"model": "resnet18", "in_chans": len(BANDS), "bands": BANDS, "publication": None},
        )

    return LocalResNet18Weights.RGBN_RANDOM


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, Path]:
    images = torch.randn(2, len(BANDS), 128, 128, generator=torch.Generator().manual_seed(9))
    path = tmp_path_factory.mktemp("batch") / "batch.pt"
    torch.save(images, path)
    return images, path


def rasterscale_config(weights_file: Path) -> dict:
    """A segmentation config that trains a U-Net on ResNet-18 from the weights file on a synthetic RGBN scene
    (rasterscale's demo scenes: crowns and their outlines, written by the workflow's demo rule)."""
    model = {"name": "rgbn", "encoder": "resnet18", "encoder_weights": str(weights_file), "band_names": BANDS}
    model |= {"labels": ["background", "tree"]}
    scene = {"path": "resources/demo/rgbn.tif", "annotations": "resources/demo/rgbn.crowns.gpkg", "bands": [1, 2, 3, 4]}
    scene |= {"normalize": "auto"}
    train = {"scenes": ["rgbn"], "devices": 2, "batch_size": 2, "epochs": 1, "max_steps": 1, "lr": 1e-9}
    train |= {"warmup_steps": 0, "validation_fraction": 0.35, "workers": 0, "accelerator": "cpu"}
    return {
        "task": "segmentation",
        "model": model,
        "scenes": {"rgbn": scene},
        "demo": {"scenes": {"rgbn": {"width": 512, "height": 512, "seed": 11, "nir": True}}},
        "tiling": {"patch_size": 256, "overlap": 64},
        "train": train,
        "predict": {"scenes": []},
    }


def rasterscale_env() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{RASTERSCALE_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    return env


def test_torchgeo_weights_start_rasterscales_encoder_with_torchgeos_features(
    weights_file: Path, torchgeo_weights: WeightsEnum, batch: tuple[torch.Tensor, Path], tmp_path: Path
) -> None:
    images, batch_path = batch
    # TorchGeo's side: its timm model, and its U-Net's encoder, each loaded by TorchGeo's own code
    backbone = resnet18(weights=torchgeo_weights).eval()
    unet = SemanticSegmentationTask(
        model="unet", backbone="resnet18", weights=torchgeo_weights, in_channels=len(BANDS), num_classes=2
    ).model.eval()
    with torch.inference_mode():
        theirs = unet.encoder(images)
        timm_stages = backbone.forward_intermediates(images, intermediates_only=True)
    # rasterscale's side, in its own environment
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(rasterscale_config(weights_file)))
    features = tmp_path / "features.pt"
    command = [str(RASTERSCALE_BIN / "python"), str(REPO / "bench/peers/rasterscale_encoder.py")]
    command += ["--config", str(config_path), "--batch", str(batch_path), "--out", str(features)]
    result = subprocess.run(command, capture_output=True, text=True, env=rasterscale_env(), timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"encoder resnet18 from {weights_file}" in result.stdout, result.stdout
    ours = torch.load(features)

    assert len(ours) == len(theirs) == 6  # the input, then strides 2 to 32
    worst = max(float((mine - torchgeos).abs().max()) for mine, torchgeos in zip(ours, theirs, strict=True))
    report(f"[encoder weights] rasterscale's encoder against TorchGeo's, 6 stages: max |diff| {worst:.2e}")
    for stage, (mine, torchgeos) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.shape == torchgeos.shape, stage
        torch.testing.assert_close(mine, torchgeos, rtol=0, atol=1e-5, msg=f"stage {stage}")
    # TorchGeo's timm model gives the same stages (strides 2, 4, 8, 16, 32; timm's stem before its max pool)
    assert len(timm_stages) == 5
    for mine, stage in zip(ours[1:], timm_stages, strict=True):
        torch.testing.assert_close(mine, stage, rtol=0, atol=1e-5)


def test_a_training_run_starts_from_the_torchgeo_weights(weights_file: Path, tmp_path: Path) -> None:
    """The workflow's training (2 CPU ranks, one step at a learning rate of 1e-9, so that the weights stay what
    they started as): its log names the file, and the model it writes holds the file's tensors in its encoder."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.yaml").write_text(yaml.safe_dump(rasterscale_config(weights_file)))
    command = [str(RASTERSCALE_BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    command += ["--configfile", str(workdir / "config.yaml"), "--cores", "2", "results/models/rgbn.pt"]
    result = subprocess.run(command, capture_output=True, text=True, env=rasterscale_env(), timeout=900, check=False)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("logs/**/*.log")))
    assert result.returncode == 0, f"{result.stderr[-4000:]}\n{logs}"
    assert f"encoder resnet18 from {weights_file}" in (workdir / "logs/train/rgbn.log").read_text()
    trained = torch.load(workdir / "results/models/rgbn.pt", map_location="cpu", weights_only=False)["state_dict"]
    started = timm_state_dict(len(BANDS))
    prefix = "net.encoder."
    encoder = {k.removeprefix(prefix): v for k, v in trained.items() if k.startswith(prefix)}
    compared = [k for k in started if not k.endswith("num_batches_tracked")]
    assert set(compared) <= set(encoder)
    convolutions = [k for k in compared if started[k].dim() == 4]
    assert len(convolutions) == 20 and encoder["conv1.weight"].shape == (64, len(BANDS), 7, 7)
    for key in convolutions:  # a step at lr 1e-9 moves a weight by about 1e-9
        torch.testing.assert_close(encoder[key], started[key], rtol=0, atol=1e-6, msg=key)
    moved = max(float((encoder[k] - started[k]).abs().max()) for k in convolutions)
    report(f"[encoder weights] trained 1 step (2 ranks): 20 convolutions within {moved:.1e} of the file's")
