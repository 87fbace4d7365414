"""The inference fast path that any convolutional model takes: batch norms folded into their convolutions,
channels_last weights and inputs. Tasks apply it to their models
(:meth:`rasterscale.tasks.api.Task.prepare_for_inference`). Which precision autocasts, and the output layers that
stay in fp32 under it: :mod:`rasterscale.runtime.precision`."""

from __future__ import annotations

import itertools

import torch
from torch.nn.utils.fusion import fuse_conv_bn_eval


def fuse_conv_bn(module: torch.nn.Module) -> int:
    """Fold every eval-mode batch norm into the convolution that feeds it (ResNet's ``convN``/``bnN`` pairs and
    ``Sequential(conv, bn, ...)`` runs); the norm becomes an identity. Returns how many were folded."""
    fused = 0
    for parent in list(module.modules()):
        children = parent._modules
        if isinstance(parent, torch.nn.Sequential):
            names = list(children)
            pairs = list(itertools.pairwise(names))
        else:
            pairs = [(f"conv{k}", f"bn{k}") for k in ("", 1, 2, 3)]
        for conv_name, bn_name in pairs:
            conv, bn = children.get(conv_name), children.get(bn_name)
            if isinstance(conv, torch.nn.Conv2d) and isinstance(bn, torch.nn.BatchNorm2d) and not bn.training:
                children[conv_name] = fuse_conv_bn_eval(conv, bn)
                children[bn_name] = torch.nn.Identity()
                fused += 1
    return fused


def channels_last_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def to_channels_last(model: torch.nn.Module, entry: torch.nn.Module) -> None:
    """channels_last weights, and inputs made channels_last where they enter ``entry`` (oneDNN and cuDNN run such
    convolutions fastest)."""
    model.to(memory_format=torch.channels_last)
    entry.register_forward_pre_hook(channels_last_input)
