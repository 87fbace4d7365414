"""What the batched detectors share (detection's RetinaNet, instances' Mask R-CNN, each in its task's ``batched``
module): torchvision's transform done for a whole batch of tiles at once, on the device, with its arithmetic;
boxes of the resized input back in tile pixels; an NMS over every tile's boxes in one call; each tile's cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import batched_nms, nms

Size = tuple[int, int]  # (height, width) in px


@dataclass(frozen=True)
class ModelInput:
    """A batch as the backbone takes it: ``images`` (B, C, H, W), normalized, resized and padded; each tile's size
    before (``tile``) and after the resize (``resized``), unpadded."""

    images: torch.Tensor
    tile: Size
    resized: Size


def model_input(transform: GeneralizedRCNNTransform, images: torch.Tensor) -> ModelInput:
    """A batch of tiles (B, C, h, w, float in [0, 1]) as torchvision's transform makes each of them, at once:
    normalized, resized when the model records a resize (``transform.native`` False: DeepForest's 800 px), padded to
    the transform's multiple (``size_divisible``) with zeros."""
    dtype, device = images.dtype, images.device
    mean = torch.as_tensor(transform.image_mean, dtype=dtype, device=device)[None, :, None, None]
    std = torch.as_tensor(transform.image_std, dtype=dtype, device=device)[None, :, None, None]
    tile: Size = (int(images.shape[-2]), int(images.shape[-1]))
    images = (images - mean) / std
    if not getattr(transform, "native", False):
        images = resized_batch(transform, images)
    resized: Size = (int(images.shape[-2]), int(images.shape[-1]))
    stride = transform.size_divisible
    padded = [int(math.ceil(side / stride) * stride) for side in resized]
    if list(resized) != padded:
        images = F.pad(images, (0, padded[1] - resized[1], 0, padded[0] - resized[0]))
    return ModelInput(images, tile, resized)


def resized_batch(transform: GeneralizedRCNNTransform, images: torch.Tensor) -> torch.Tensor:
    """torchvision's evaluation resize (``min_size[-1]``, ``max_size`` or ``fixed_size``: one bilinear interpolation,
    the scale recomputed from the output size), over the whole batch."""
    if transform.fixed_size is not None:
        size = [transform.fixed_size[1], transform.fixed_size[0]]
        return F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    height, width = images.shape[-2:]
    scale = min(transform.min_size[-1] / min(height, width), transform.max_size / max(height, width))
    return F.interpolate(images, scale_factor=scale, mode="bilinear", recompute_scale_factor=True, align_corners=False)


def to_tile_pixels(boxes: torch.Tensor, batch: ModelInput) -> torch.Tensor:
    """Boxes of the resized input back in tile pixels (torchvision's ``resize_boxes``, the same arithmetic)."""
    if batch.resized == batch.tile:
        return boxes
    ratio_height, ratio_width = (
        torch.tensor(tile, dtype=torch.float32, device=boxes.device)
        / torch.tensor(resized, dtype=torch.float32, device=boxes.device)
        for tile, resized in zip(batch.tile, batch.resized, strict=True)
    )
    x0, y0, x1, y1 = boxes.unbind(1)
    return torch.stack((x0 * ratio_width, y0 * ratio_height, x1 * ratio_width, y1 * ratio_height), dim=1)


def nms_by_group(
    boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor, threshold: float, one_call: bool | None = None
) -> torch.Tensor:
    """torchvision's ``batched_nms`` (boxes of different ``groups``, a tile's class or level, never suppress each
    other; indices kept by decreasing score), in one NMS on a GPU however many boxes: torchvision switches to one
    NMS per group past 5,000 boxes there, a Python loop over a batch's tiles and classes. Each group's boxes are
    moved to a cell of their own on a square grid of cells (offsets on both axes keep the coordinates, and so the
    IoUs, as exact as a few groups' would be). Elsewhere torchvision's own (one NMS per group on a CPU: exact);
    ``one_call``: the one NMS anyway (True), or torchvision's (False), whatever the device."""
    if one_call is None:
        one_call = boxes.device.type == "cuda"
    if not one_call or boxes.numel() == 0:
        return batched_nms(boxes, scores, groups, threshold)
    side = boxes.max() + 1
    columns = math.ceil(math.sqrt(int(groups.max()) + 1))
    shift = torch.stack((groups % columns, groups // columns), dim=1).to(boxes) * side
    return nms(boxes + shift.repeat(1, 2), scores, threshold)


def first_of_each_tile(keep: torch.Tensor, tiles: torch.Tensor, cap: int) -> torch.Tensor:
    """``keep`` (indices by decreasing score, as an NMS returns them) put tile by tile, each tile's by score, and
    cut at ``cap`` per tile (``tiles``: each index's tile)."""
    keep = keep[torch.sort(tiles[keep], stable=True).indices]
    kept_tiles = tiles[keep]
    firsts = torch.searchsorted(kept_tiles, kept_tiles, right=False)
    return keep[torch.arange(len(keep), device=keep.device) - firsts < cap]
