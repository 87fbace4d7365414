"""The torch side of a model's input bands (:class:`~rasterscale.raster.bands.InputBands`): the normalization every
model applies first, on the device, the first convolution of a network adapted to N bands from an RGB start, and a
dense network's input padded to its encoder's stride (:func:`run_padded`).

Adapting a first convolution (``weight`` of shape (out, 3, k, k)) to N bands keeps the RGB filters for the bands
whose names give them a role (red, green, blue) unchanged; every other band starts from the mean of the RGB filters
scaled by 3/N, as timm (``adapt_input_conv``) and TorchGeo initialize extra bands.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from rasterscale.raster.bands import RGB_NAMES, InputBands, rgb_roles


class Normalize(torch.nn.Module):
    """``(x - mean) / std`` per band, the statistics of an :class:`InputBands` (buffers, not saved: they come from
    the model file's record)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, bands: InputBands) -> None:
        super().__init__()
        if bands.pending:
            raise ValueError("the input's statistics are not computed yet (normalize: auto)")
        shape = (1, bands.count, 1, 1)
        self.register_buffer("mean", torch.tensor(bands.mean, dtype=torch.float32).view(shape), persistent=False)
        self.register_buffer("std", torch.tensor(bands.std, dtype=torch.float32).view(shape), persistent=False)
        self.identity = all(m == 0 for m in bands.mean) and all(d == 1 for d in bands.std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.identity:  # mean 0 and std 1 (a card without normalize): the same values, two passes saved
            return images
        return (images - self.mean).div_(self.std)


def adapt_first_conv(
    weight: torch.Tensor, bands: InputBands, source: InputBands | None = None
) -> tuple[torch.Tensor, str]:
    """A first convolution's RGB ``weight`` (out, 3, k, k) adapted to ``bands``; and what was done, for the log.
    ``source``: the start's bands (None: red, green, blue). An input that is the start's is returned as is (and
    nothing to log: an empty text)."""
    source_names = source.names if source is not None else RGB_NAMES
    if weight.shape[1] != len(source_names):
        raise ValueError(f"the first convolution takes {weight.shape[1]} bands, its model {len(source_names)}")
    if [n.casefold() for n in source_names] == [n.casefold() for n in bands.names]:
        return weight, ""
    source_roles = rgb_roles(source_names)
    if set(source_roles) != set(RGB_NAMES):
        raise ValueError(f"the start's bands [{', '.join(source_names)}] have no red, green and blue to adapt from")
    rgb = weight[:, [source_roles[role] for role in RGB_NAMES]]
    roles = rgb_roles(bands.names)
    extra = rgb.mean(dim=1) * (3.0 / bands.count)
    adapted = extra.unsqueeze(1).repeat(1, bands.count, 1, 1)
    for k, role in enumerate(RGB_NAMES):
        if role in roles:
            adapted[:, roles[role]] = rgb[:, k]
    kept = [f"{role} -> band {roles[role] + 1} ({bands.names[roles[role]]})" for role in RGB_NAMES if role in roles]
    others = [name for index, name in enumerate(bands.names) if index not in roles.values()]
    text = f"first convolution adapted from 3 to {bands.count} bands: RGB filters kept ({', '.join(kept) or 'none'})"
    if others:
        text += f"; {', '.join(others)} from the mean of the RGB filters x 3/{bands.count}"
    return adapted.contiguous(), text


def first_conv_key(state_dict: Mapping[str, torch.Tensor]) -> str:
    """The key of a network's first convolution weight: the first 4-D tensor of its state dict (in module order)."""
    key = next((k for k, v in state_dict.items() if v.dim() == 4), None)
    if key is None:
        raise ValueError("no convolution in the state dict")
    return key


def adapt_state_dict(
    state_dict: Mapping[str, torch.Tensor], bands: InputBands, source: InputBands | None, key: str | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """A start's weights with its first convolution (``key``, else :func:`first_conv_key`) adapted to ``bands``
    (:func:`adapt_first_conv`); and what was done, for the log."""
    state = dict(state_dict)
    key = key or first_conv_key(state)
    state[key], text = adapt_first_conv(state[key], bands, source)
    return state, text


def and_then(text: str) -> str:
    """``"; text"`` to append what an adaptation did to a log line, nothing when it did nothing."""
    return f"; {text}" if text else ""


STRIDE = 32  # a dense network's encoder's output stride: its inputs are padded to a multiple of it


def run_padded(net: torch.nn.Module, x: torch.Tensor, stride: int = STRIDE) -> torch.Tensor:
    """``net`` over ``x`` (N, B, H, W) padded on its bottom and right to a multiple of ``stride`` (reflected, or
    replicated where the tile is smaller than the padding), its output cropped back to (H, W)."""
    height, width = x.shape[-2:]
    pad_h, pad_w = -height % stride, -width % stride
    if pad_h or pad_w:
        mode = "reflect" if pad_h < height and pad_w < width else "replicate"
        x = F.pad(x, (0, pad_w, 0, pad_h), mode=mode)
    return net(x)[..., :height, :width]
