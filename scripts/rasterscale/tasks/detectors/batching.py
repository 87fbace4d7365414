"""What the batched detectors share (detection's RetinaNet, instances' Mask R-CNN, each in its task's ``batched``
module): torchvision's transform done for a whole batch of tiles at once, on the device, with its arithmetic;
anchors made once per input size; boxes of the resized input back in tile pixels; an NMS over every tile's boxes
in one call; each tile's cap; a batch's objects, cut into runs of tiles.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, fields, replace
from typing import ClassVar, Self, cast

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import nms

Size = tuple[int, int]  # (height, width) in px


@dataclass(frozen=True)
class TileObjects:
    """A batch's objects on its device, one tensor per kind (a subclass's fields) along their first dimension, and
    ``tiles`` (N, int64): each object's tile in the batch, tiles in order, a tile's objects by score; ``count``:
    the tiles of the batch (some may have none)."""

    tiles: torch.Tensor
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, part: slice) -> Self:
        """The objects of the tiles ``part`` of the batch (a run of one scene's tiles), their tiles numbered from
        0."""
        start, stop, step = part.indices(self.count)
        if step != 1:
            raise ValueError("a run of tiles is contiguous")
        if (start, stop) == (0, self.count):
            return self
        keep = (self.tiles >= start) & (self.tiles < stop)
        kinds = {field.name: getattr(self, field.name)[keep] for field in fields(self) if field.name not in RUN_FIELDS}
        return replace(self, tiles=self.tiles[keep] - start, count=max(0, stop - start), **kinds)


RUN_FIELDS = ("tiles", "count")  # what :class:`TileObjects` itself holds: the rest are its objects' kinds


def packed_columns(*columns: torch.Tensor) -> torch.Tensor:
    """(N, k) float32: a batch's kinds of objects ((N,) or (N, j) each) side by side, one tensor to copy to the host
    (labels, tiles and pixel offsets exact in fp32)."""
    return torch.cat([(c[:, None] if c.dim() == 1 else c).to(torch.float32) for c in columns], dim=1)


def tile_rows(tiles: np.ndarray, count: int) -> list[tuple[int, int]]:
    """Each of ``count`` tiles' run of rows (first, stop) in a host copy of a batch's objects, from their ``tiles``
    column (tiles in order; a tile without objects, an empty run)."""
    return list(itertools.pairwise(np.searchsorted(tiles, np.arange(count + 1), side="left").tolist()))


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


class Anchors:
    """A detector's anchors (a RetinaNet's, a region proposal network's) of each input size (and its feature maps'
    sizes), made once in fp32 by its anchor generator and kept: every batch of a rank has the same few sizes.
    :meth:`of_model`: a model's, kept while the model lives."""

    kept: ClassVar[weakref.WeakKeyDictionary[AnchorGenerator, Anchors]] = weakref.WeakKeyDictionary()

    def __init__(self, generator: AnchorGenerator) -> None:
        self.generator = generator
        self.made: dict[tuple, list[torch.Tensor]] = {}

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> Anchors:
        """The anchors of ``model``'s anchor generator (a RetinaNet's, a region proposal network's)."""
        generator = cast(AnchorGenerator, model.anchor_generator)
        if generator not in cls.kept:
            cls.kept[generator] = cls(generator)
        return cls.kept[generator]

    def of(self, size: Size, grids: list[Size], device: torch.device) -> list[torch.Tensor]:
        """Each level's anchors (HWA, 4) of an input of ``size`` whose feature maps are ``grids``."""
        key = (size, tuple(grids), str(device))
        if key not in self.made:
            strides = [
                [torch.tensor(size[0] // g[0], dtype=torch.int64, device=device)]
                + [torch.tensor(size[1] // g[1], dtype=torch.int64, device=device)]
                for g in grids
            ]
            with torch.autocast(device.type, enabled=False):
                self.generator.set_cell_anchors(torch.float32, device)
                self.made[key] = self.generator.grid_anchors([list(g) for g in grids], strides)
        return self.made[key]


NMS_CALL_BOXES = 16_384  # boxes in one NMS call over many groups: its suppression mask takes N² / 8 bytes (32 MB)


def nms_by_group(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    groups: torch.Tensor,
    threshold: float,
    one_call: bool | None = None,
    call_boxes: int = NMS_CALL_BOXES,
) -> torch.Tensor:
    """An NMS within each group (a tile's class, or level), boxes of different groups never suppressing each other:
    the indices kept, by decreasing score (equal scores in index order). A tile's boxes come out the same whatever
    the other tiles of its batch: torchvision's ``batched_nms`` moves each group's boxes by its index in float32
    below 1,000 boxes on a CPU (5,000 on a GPU), which rounds them by the tile's place in the batch, and loops over
    the groups above.

    On a GPU (``one_call``), one NMS over many groups (:func:`grid_nms`), in runs of whole groups of at most
    ``call_boxes`` boxes (a group larger alone): the work and the memory of an NMS grow with the square of its
    boxes, and boxes of different groups never meet (a batch of 16 Mask R-CNN tiles at 800 px proposes about
    72,000 boxes: a 650 MB mask in one call). Elsewhere one NMS per group."""
    if one_call is None:
        one_call = boxes.device.type == "cuda"
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    if one_call:
        runs = group_runs(groups, call_boxes)
        if len(runs) == 1:
            keep = grid_nms(boxes, scores, groups, threshold)
        else:
            keeps = []
            for first, stop in runs:
                members = torch.where((groups >= first) & (groups < stop))[0]
                keeps.append(members[grid_nms(boxes[members], scores[members], groups[members] - first, threshold)])
            keep = torch.cat(keeps)
    else:
        kept = torch.zeros(len(boxes), dtype=torch.bool, device=boxes.device)
        for group in torch.unique(groups):
            members = torch.where(groups == group)[0]
            kept[members[nms(boxes[members], scores[members], threshold)]] = True
        keep = torch.where(kept)[0]
    keep = torch.sort(keep).values  # equal scores in index order, whatever order the NMS gave them
    return keep[torch.sort(scores[keep], descending=True, stable=True).indices]


def group_runs(groups: torch.Tensor, call_boxes: int) -> list[tuple[int, int]]:
    """Runs of consecutive group ids ``(first, stop)`` of at most ``call_boxes`` boxes each (a larger group alone)."""
    runs, first, total = [], 0, 0
    counts = torch.bincount(groups).tolist()
    for group, count in enumerate(counts):
        if total and total + count > call_boxes:
            runs.append((first, group))
            first, total = group, 0
        total += count
    runs.append((first, len(counts)))
    return runs


def grid_nms(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor, threshold: float) -> torch.Tensor:
    """One NMS over every group, each group's boxes moved to a cell of their own on a square grid, in float64,
    where the move is exact; the cells' side spans every finite coordinate (a box with a NaN in it suppresses
    nothing and is kept, as by an NMS per group, and leaves the others' cells as they are)."""
    exact = boxes.double()
    finite = torch.where(torch.isfinite(exact), exact, 0.0)
    low = finite.min().clamp(max=0.0)
    side = finite.max() - low + 1
    columns = math.ceil(math.sqrt(int(groups.max()) + 1))
    shift = torch.stack((groups % columns, groups // columns), dim=1).double() * side
    return nms(exact - low + shift.repeat(1, 2), scores.double(), threshold)


def first_of_each_tile(keep: torch.Tensor, tiles: torch.Tensor, cap: int) -> torch.Tensor:
    """``keep`` (indices by decreasing score, as an NMS returns them) put tile by tile, each tile's by score, and
    cut at ``cap`` per tile (``tiles``: each index's tile)."""
    keep = keep[torch.sort(tiles[keep], stable=True).indices]
    kept_tiles = tiles[keep]
    firsts = torch.searchsorted(kept_tiles, kept_tiles, right=False)
    return keep[torch.arange(len(keep), device=keep.device) - firsts < cap]
