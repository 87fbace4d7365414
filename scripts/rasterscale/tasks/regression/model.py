"""The regressor: a segmentation-models-pytorch network (a U-Net on ResNet-18 by default; any architecture and
encoder of :mod:`rasterscale.tasks.encoders`) with a linear head of one channel per predicted value, built without
download (:mod:`rasterscale.tasks.smpnet`).

The module takes tiles as float (N, B, H, W) of its input bands (``RegressorConfig.input``: in [0, 1] when scaled,
raw values otherwise), normalizes them itself (:class:`~rasterscale.tasks.inputlayer.Normalize`, first), pads them
to a multiple of 32 (the encoder's stride) and crops the output back. The network predicts standardized values;
the module returns them in target units (``* std + mean``, the targets' scale measured on the training tiles when
training starts: :meth:`Regressor.set_target_scale`), so a height of 0-30 m trains as well as one of 0-1. The head
(smp's segmentation head: a convolution, then the architecture's upsampling, no activation) runs in fp32 under
autocast, whatever the architecture.

Its files: :mod:`rasterscale.tasks.regression.modelfiles` (torch-free), which :func:`load_regressor` and
:func:`save_regressor` read and write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from rasterscale.tasks.dense import load_weights
from rasterscale.tasks.inputlayer import Normalize, run_padded
from rasterscale.tasks.modelfiles import save_payload
from rasterscale.tasks.regression.modelfiles import (
    REGRESSOR_FORMAT,
    RegressorConfig,
    config_of_payload,
    regressor_payload,
)
from rasterscale.tasks.smpnet import build_network, load_encoder_weights

__all__ = ["Regressor", "build_regressor", "load_regressor", "save_regressor", "start_encoder"]


class Regressor(torch.nn.Module):
    """An smp network (``.net``) behind its input's normalization and padding to a multiple of the encoder's stride
    (:func:`~rasterscale.tasks.inputlayer.run_padded`), its
    outputs scaled to target units."""

    target_mean: torch.Tensor  # buffers (registered in __init__; the model file's config records them)
    target_std: torch.Tensor

    def __init__(self, net: torch.nn.Module, cfg: RegressorConfig) -> None:
        super().__init__()
        self.net = net
        self.normalize = Normalize(cfg.input)
        self.register_buffer("target_mean", torch.zeros(1, cfg.outputs, 1, 1), persistent=False)
        self.register_buffer("target_std", torch.ones(1, cfg.outputs, 1, 1), persistent=False)
        self.set_target_scale(*cfg.scale)

    def set_target_scale(self, mean: Sequence[float], std: Sequence[float]) -> None:
        """The targets' mean and std per output, by which the network's standardized outputs are scaled back."""
        shape = self.target_mean.shape
        self.target_mean.copy_(torch.tensor(list(mean), dtype=torch.float32).view(shape))
        self.target_std.copy_(torch.tensor(list(std), dtype=torch.float32).view(shape))

    @property
    def target_scale(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return tuple(self.target_mean.flatten().tolist()), tuple(self.target_std.flatten().tolist())

    def standardized(self, values: torch.Tensor) -> torch.Tensor:
        """Values in target units (N, K, H, W) in the network's standardized units."""
        return (values - self.target_mean) / self.target_std

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Float (N, B, H, W) (scaled to [0, 1], or raw values) -> values (N, K, H, W) in target units, float32."""
        out = run_padded(self.net, self.normalize(images)).float()
        return out * self.target_std + self.target_mean


def build_regressor(cfg: RegressorConfig) -> Regressor:
    """A freshly initialized regressor (no pretrained weights, nothing downloaded), its linear head in fp32 under
    autocast."""
    net = build_network(cfg.architecture, cfg.encoder, cfg.input.count, cfg.outputs, cfg.decoder_channels)
    return Regressor(net, cfg)


def start_encoder(model: torch.nn.Module, cfg: RegressorConfig, path: str | Path) -> str:
    """Start the regressor's encoder from a local weights file (``model.encoder_weights``); a line for the log."""
    return load_encoder_weights(model.get_submodule("net.encoder"), path, cfg.encoder)


def with_target_scale(model: torch.nn.Module, cfg: RegressorConfig) -> RegressorConfig:
    """The configuration with the model's target scale (what training measured), as its file records it."""
    regressor = cast(Regressor, getattr(model, "module", model))
    mean, std = regressor.target_scale
    return replace(cfg, target_mean=mean, target_std=std)


def save_regressor(model: torch.nn.Module, cfg: RegressorConfig, path: str | Path, **meta: Any) -> RegressorConfig:
    """Write a regressor file atomically (a DDP wrapper's ``.module`` is saved, not the wrapper), its config with
    the model's target scale; returns that config."""
    cfg = with_target_scale(model, cfg)
    save_payload(path, REGRESSOR_FORMAT, cfg.to_dict(), model, task="regression", meta=meta)
    return cfg


def load_regressor(path: str | Path) -> tuple[Regressor, RegressorConfig, dict[str, Any]]:
    """The regressor of a file, its configuration and its metadata."""
    payload = regressor_payload(path)
    cfg = config_of_payload(path, payload)
    model = build_regressor(cfg)
    load_weights(model, payload, path, cfg.describe)
    return model, cfg, dict(payload.get("meta", {}))
