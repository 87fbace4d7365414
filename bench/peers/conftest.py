"""rasterscale checked against a real peer, TorchGeo 0.8.1 (``make test-peers``, not part of ``make test``). Runs in
TorchGeo's own environment (``.venv-peers``: TorchGeo, ONNX and ONNX Runtime are not rasterscale's dependencies),
from the repository root:

    .venv-peers/bin/python -m pytest -p no:cacheprovider -c /dev/null --rootdir . bench/peers -q

- ``test_exported_models.py``: a TorchGeo U-Net (random weights: nothing can be downloaded here) exported as
  TorchScript, a ``torch.export`` program and ONNX, each with a model card beside it, predicts a synthetic GeoTIFF
  through the real workflow in rasterscale's own environment (``.venv/bin/snakemake``, 2 CPU ranks), and the class
  map equals what the TorchGeo model gives when plain PyTorch code runs it over the same tile windows;
- ``test_encoder_weights.py``: a ResNet state dict as TorchGeo publishes its pretrained weights (a
  ``timm.create_model("resnet18", in_chans=N)`` state dict without ``fc.*``) loads into rasterscale's training
  through ``model.encoder_weights`` and gives the features TorchGeo's own loading gives.

The figures each test measures are printed in the terminal summary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import rasterio
from affine import Affine

REPO = Path(__file__).resolve().parents[2]
RASTERSCALE_BIN = REPO / ".venv/bin"  # rasterscale's own environment (`make` builds it)
FIGURES: list[str] = []


def report(text: str) -> None:
    """A figure a test measured, printed in the terminal summary."""
    FIGURES.append(text)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("peers: measured")
        for line in FIGURES:
            terminalreporter.write_line(line)


def rasterscale_importable() -> None:
    """rasterscale's package (scripts/rasterscale) on the path of this environment: torch, smp, timm, rasterio,
    pandas and yaml at rasterscale's pins are here too."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)


def smooth_field(rng: np.random.Generator, height: int, width: int, scale: float) -> np.ndarray:
    """A random field with features about ``scale`` px across, in [0, 1] (white noise low-passed in Fourier space)."""
    noise = np.fft.rfft2(rng.standard_normal((height, width)))
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    field = np.fft.irfft2(noise * np.exp(-((fx**2 + fy**2) * (np.pi * scale) ** 2)), s=(height, width))
    return (field - field.min()) / (field.max() - field.min())


def write_scene(path: Path, width: int, height: int, seed: int) -> Path:
    """An RGB uint8 GeoTIFF (UTM 33N, 0.5 m pixels, band colour interpretation red, green, blue): fields (greens
    and browns at two scales), bright round crowns with dark shadows, and sensor noise: texture a convolutional
    network's classes follow, at every tile offset."""
    rng = np.random.default_rng(seed)
    coarse, fine = smooth_field(rng, height, width, 40), smooth_field(rng, height, width, 6)
    rgb = np.stack([90 + 70 * coarse, 110 + 60 * (1 - coarse), 70 + 40 * coarse]) + 40 * (fine - 0.5)
    rows, cols = np.mgrid[0:height, 0:width]
    for _ in range(60):
        y, x, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(6, 18)
        inside = (rows - y) ** 2 + (cols - x) ** 2 < r**2
        shadow = ((rows - y - r / 2) ** 2 + (cols - x - r / 2) ** 2 < r**2) & ~inside
        rgb[:, shadow] *= 0.55
        rgb[:, inside] = np.array([40, 150, 50])[:, None] + rng.normal(0, 12, (3, int(inside.sum())))
    rgb += rng.normal(0, 4, rgb.shape)
    data = np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
    profile = {
        "driver": "GTiff",
        "width": width,
        "height": height,
        "count": 3,
        "dtype": "uint8",
        "crs": "EPSG:32633",
        "transform": Affine(0.5, 0, 500_000, 0, -0.5, 5_200_000),
        "photometric": "RGB",
        "tiled": True,
        "blockxsize": 256,
        "blockysize": 256,
    }
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(data)
    return path
