"""The point model: a segmentation-models-pytorch network (a U-Net on ResNet-18 by default; any architecture and
encoder of :mod:`rasterscale.tasks.encoders`) whose head gives one heatmap channel per class, built without download
(:mod:`rasterscale.tasks.smpnet`).

The module takes tiles as float (N, B, H, W) of its input bands, normalizes them itself
(:class:`~rasterscale.tasks.inputlayer.Normalize`), pads them to a multiple of the encoder's stride and crops the
output back; it returns the heatmap's logits (N, K, H, W) in fp32 (the head runs in fp32 under autocast). The head's
bias starts at CenterNet's prior (a point in about 1 % of the pixels), so that the focal loss starts stable.

Its files: :mod:`rasterscale.tasks.points.modelfiles` (torch-free), which :func:`load_points_model` and
:func:`save_points_model` read and write.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import torch

from rasterscale.tasks.dense import load_weights
from rasterscale.tasks.inputlayer import Normalize, run_padded
from rasterscale.tasks.modelfiles import save_payload
from rasterscale.tasks.points.modelfiles import POINTS_FORMAT, PointsConfig, config_of_payload, points_payload
from rasterscale.tasks.smpnet import build_network, load_encoder_weights

__all__ = ["PointModel", "build_points_model", "load_points_model", "save_points_model", "start_encoder"]

PRIOR = 0.01  # the head's initial probability of a point at a pixel


class PointModel(torch.nn.Module):
    """An smp network (``.net``) behind its input's normalization and padding; its output is the heatmap's logits."""

    def __init__(self, net: torch.nn.Module, cfg: PointsConfig) -> None:
        super().__init__()
        self.net = net
        self.normalize = Normalize(cfg.input)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Float (N, B, H, W) (scaled to [0, 1], or raw values) -> logits (N, K, H, W), float32."""
        return run_padded(self.net, self.normalize(images)).float()


def build_points_model(cfg: PointsConfig) -> PointModel:
    """A freshly initialized point model (no pretrained weights, nothing downloaded), its head's bias at
    :data:`PRIOR`."""
    net = build_network(cfg.architecture, cfg.encoder, cfg.input.count, cfg.outputs, cfg.decoder_channels)
    head = cast(
        torch.nn.Conv2d, cast(torch.nn.Sequential, net.segmentation_head)[0]
    )  # a convolution with a bias (smp's head, in fp32: smpnet)
    torch.nn.init.constant_(cast(torch.Tensor, head.bias), -math.log((1 - PRIOR) / PRIOR))
    return PointModel(net, cfg)


def start_encoder(model: torch.nn.Module, cfg: PointsConfig, path: str | Path) -> str:
    """Start the model's encoder from a local weights file (``model.encoder_weights``); a line for the log."""
    return load_encoder_weights(model.get_submodule("net.encoder"), path, cfg.encoder)


def save_points_model(model: torch.nn.Module, cfg: PointsConfig, path: str | Path, **meta: Any) -> None:
    """Write a point model file atomically (a DDP wrapper's ``.module`` is saved, not the wrapper)."""
    save_payload(path, POINTS_FORMAT, cfg.to_dict(), model, task="points", meta=meta)


def load_points_model(path: str | Path) -> tuple[PointModel, PointsConfig, dict[str, Any]]:
    """The point model of a file, its configuration and its metadata."""
    payload = points_payload(path)
    cfg = config_of_payload(path, payload)
    model = build_points_model(cfg)
    load_weights(model, payload, path, cfg.describe)
    return model, cfg, dict(payload.get("meta", {}))
