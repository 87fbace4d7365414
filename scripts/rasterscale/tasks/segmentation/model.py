"""The segmenter: a segmentation_models_pytorch network (U-Net on a ResNet-18 by default; any architecture and
encoder of :mod:`rasterscale.tasks.encoders`), built without download (:mod:`rasterscale.tasks.smpnet`).

The module takes tiles as float (N, B, H, W) of its input bands (``SegmenterConfig.input``: in [0, 1] when scaled,
raw values otherwise), normalizes them itself (ImageNet's statistics for RGB, the input's own otherwise), pads them
to a multiple of 32 (the encoder's stride) and crops the logits back: it returns logits (N, C, H, W), one channel
per class of ``SegmenterConfig.labels``.

Its files: :mod:`rasterscale.tasks.segmentation.modelfiles` (torch-free), which :func:`load_segmenter` and
:func:`save_segmenter` read and write.

The U-Net's default decoder here is half as wide as smp's (:data:`UNET_DECODER`, 12.5 M parameters instead of
14.3 M): on a CPU a training step (forward, backward, AdamW) costs 1.5-2x less per tile (one thread: 0.19 s instead
of 0.28 s at 256 px, 0.49 s instead of 0.77 s at 400 px) and it learns the synthetic crowns at least as fast
(held-out mIoU 0.87 after 20 steps of 4 tiles of 256 px, 0.96 after 60; smp's decoder: 0.76 and 0.95).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rasterscale.errors import InputError
from rasterscale.raster.bands import InputBands
from rasterscale.tasks.dense import load_weights
from rasterscale.tasks.inputlayer import Normalize, run_padded
from rasterscale.tasks.modelfiles import save_payload
from rasterscale.tasks.segmentation.modelfiles import (
    SEGMENTER_FORMAT,
    SegmenterConfig,
    config_of_payload,
    segmenter_payload,
)
from rasterscale.tasks.smpnet import build_network, load_encoder_weights

__all__ = ["Segmenter", "build_segmenter", "load_segmenter", "save_segmenter", "start_encoder"]


class Segmenter(torch.nn.Module):
    """An smp network (``.net``) behind its input's normalization and padding to a multiple of the encoder's stride
    (:func:`~rasterscale.tasks.inputlayer.run_padded`)."""

    def __init__(self, net: torch.nn.Module, bands: InputBands | None = None) -> None:
        super().__init__()
        self.net = net
        self.normalize = Normalize(bands or InputBands())

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Float (N, B, H, W) (scaled to [0, 1], or raw values) -> logits (N, C, H, W)."""
        return run_padded(self.net, self.normalize(images))


def build_segmenter(cfg: SegmenterConfig) -> Segmenter:
    """A freshly initialized segmenter (no pretrained weights, nothing downloaded), its head in fp32 under
    autocast."""
    net = build_network(cfg.architecture, cfg.encoder, cfg.input.count, cfg.num_classes, cfg.decoder_channels)
    return Segmenter(net, cfg.input)


def start_encoder(model: torch.nn.Module, cfg: SegmenterConfig, path: str | Path) -> str:
    """Start the segmenter's encoder from a local weights file (``model.encoder_weights``); a line for the log."""
    return load_encoder_weights(model.get_submodule("net.encoder"), path, cfg.encoder)


def save_segmenter(model: torch.nn.Module, cfg: SegmenterConfig, path: str | Path, **meta: Any) -> None:
    """Write a segmenter file atomically (a DDP wrapper's ``.module`` is saved, not the wrapper)."""

    save_payload(path, SEGMENTER_FORMAT, cfg.to_dict(), model, task="segmentation", meta=meta)


def load_segmenter(
    path: str | Path, labels_override: tuple[str, ...] | list[str] | None = None
) -> tuple[Segmenter, SegmenterConfig, dict[str, Any]]:
    """The segmenter of a file, its configuration and its metadata. ``labels_override`` renames the classes
    (``model.labels``); it must name as many classes as the file has."""
    payload = segmenter_payload(path)
    cfg = config_of_payload(path, payload)
    if labels_override:
        if len(labels_override) != cfg.num_classes:
            raise InputError(
                f"{path}: model.labels names {len(labels_override)} classes but the segmenter has "
                f"{cfg.num_classes} ({', '.join(cfg.labels)})"
            )
        cfg = SegmenterConfig.from_dict({**cfg.to_dict(), "labels": list(labels_override)})
    model = build_segmenter(cfg)
    load_weights(model, payload, path, cfg.describe)
    return model, cfg, dict(payload.get("meta", {}))
