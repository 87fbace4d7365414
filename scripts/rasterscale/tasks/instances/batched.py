"""Mask R-CNN over a batch of tiles as one tensor on the device: what torchvision's Mask R-CNN does image by image
(its transform, the region proposals' filtering, the boxes' selection, the masks pasted into the tile one by one),
done for the whole batch at once, with the same arithmetic but the masks' interpolation.

- **Pre-processing**: the batch normalized, resized and padded at once
  (:func:`~rasterscale.tasks.detectors.batching.model_input`, shared with RetinaNet).
- **Proposals** (:func:`proposals`): the region proposal network's anchors made once per input size in fp32
  (:class:`~rasterscale.tasks.detectors.batching.Anchors`), its boxes decoded for the batch, each level's
  ``pre_nms_top_n`` of every tile at once (torchvision's own top-k), then the small and low-scoring ones dropped and
  one NMS over the batch (tile and level in its key), and each tile's ``post_nms_top_n``.
- **Boxes** (:func:`instances_of`): the box head over every tile's proposals (torchvision's RoI pooling takes them
  together), class scores and boxes decoded for the batch, then background, low scores and empty boxes dropped,
  one NMS over the batch (tile and class in its key) and each tile's cap (``detections_per_img``).
- **Masks**: the mask head over every instance at once (:func:`mask_logits`), each instance's class channel; pasted
  into its tile by :func:`paste_masks`: torchvision pads each 28 x 28 mask by a pixel, widens its box to match and
  interpolates it bilinearly into the box, one mask at a time (a host round trip per mask on a GPU); here the
  interpolation is two batched matrix products (rows, then columns: bilinear is separable) for every mask at once,
  each over its crop of the tile only (its widened box), where torchvision fills a whole tile per mask.
  Probabilities agree with torchvision's to float rounding (a sum in another order); thresholded masks differ only
  at pixels within that rounding of ``mask_threshold``.

The result (:class:`BatchInstances`) is one tensor per kind for the batch, tiles in order, a tile's instances by
score, the masks thresholded on the device (uint8, a quarter of the bytes to copy) and cut to the batch's largest
crop with each one's origin in its tile: what the merge needs of them (the polygons are traced on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.models.detection import MaskRCNN
from torchvision.ops import clip_boxes_to_image, remove_small_boxes

from rasterscale.tasks.detectors.batching import (
    Anchors,
    ModelInput,
    Size,
    TileObjects,
    first_of_each_tile,
    model_input,
    nms_by_group,
    packed_columns,
    to_tile_pixels,
)

MASK_PADDING = 1  # torchvision pads a mask by a pixel before pasting it (paste_masks_in_image)
EMPTY_BOX = 1e-2  # torchvision drops boxes narrower than this (px) before the boxes' NMS
PACKED_COLUMNS = 9  # a packed instance: x0, y0, x1, y1, score, label, origin column, origin row, tile
MASK_ROWS_STEP = 64  # under cuDNN's autotuning the mask head's regions come in multiples of this (mask_logits)


@dataclass(frozen=True)
class BatchInstances(TileObjects):
    """A batch's instances on its device (:class:`~rasterscale.tasks.detectors.batching.TileObjects`): ``boxes``
    (N, 4, tile pixels), ``scores``, ``labels``, ``masks`` (N, h, w: uint8 0/1; float probabilities when asked),
    each the crop of its tile from its ``origins`` (N, 2, int64: column, row; zeros and the tile's size where the
    masks are the whole tile's), zero beyond the instance's own crop and the tile (:func:`tile_masks`)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    masks: torch.Tensor
    origins: torch.Tensor

    def packed(self) -> torch.Tensor:
        """(N, :data:`PACKED_COLUMNS`) float32: each instance's box, score, label, origin (column, row) and tile, one
        tensor to copy beside the masks (labels, origins and tiles exact in fp32)."""
        return packed_columns(self.boxes, self.scores, self.labels, self.origins, self.tiles)


@dataclass(frozen=True)
class MaskLogits:
    """The network's output for a batch, before the masks are pasted: each instance's box (in the resized input's
    pixels), score, label (0-based, as :class:`~rasterscale.tasks.instances.model.InstanceSegmenter` gives them),
    tile and mask logits (N, M, M) of its class; the input's sizes; the model's mask threshold."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    tiles: torch.Tensor
    logits: torch.Tensor
    input: ModelInput
    count: int
    threshold: float


def proposals(model: MaskRCNN, batch: ModelInput, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tile's region proposals (torchvision's region proposal network in evaluation, for the batch at once)."""
    rpn = model.rpn
    count = int(batch.images.shape[0])
    objectness, deltas = rpn.head(features)
    grids: list[Size] = [(int(f.shape[-2]), int(f.shape[-1])) for f in features]
    padded: Size = (int(batch.images.shape[-2]), int(batch.images.shape[-1]))
    anchors = torch.cat(Anchors.of_model(rpn).of(padded, grids, batch.images.device))
    per_level = [int(o.shape[1] * o.shape[2] * o.shape[3]) for o in objectness]
    scores = torch.cat([o.permute(0, 2, 3, 1).reshape(count, -1) for o in objectness], dim=1)
    codes = torch.cat(
        [d.view(count, -1, 4, *d.shape[-2:]).permute(0, 3, 4, 1, 2).reshape(count, -1, 4) for d in deltas], 1
    )
    boxes = rpn.box_coder.decode_single(codes.reshape(-1, 4), anchors.repeat(count, 1)).view(count, -1, 4)
    top = top_per_level(scores, per_level, rpn.pre_nms_top_n())
    levels = torch.cat([torch.full((n,), k, device=scores.device) for k, n in enumerate(per_level)])[top]
    rows = torch.arange(count, device=scores.device)[:, None]
    boxes = clip_boxes_to_image(boxes[rows, top].reshape(-1, 4), batch.resized)
    scores = torch.sigmoid(scores[rows, top]).reshape(-1)
    tiles = rows.expand_as(top).reshape(-1)
    levels = levels.reshape(-1)
    keep = remove_small_boxes(boxes, rpn.min_size)
    keep = keep[scores[keep] >= rpn.score_thresh]
    kept = nms_by_group(boxes[keep], scores[keep], tiles[keep] * len(per_level) + levels[keep], rpn.nms_thresh)
    keep = keep[first_of_each_tile(kept, tiles[keep], rpn.post_nms_top_n())]
    return per_tile(boxes[keep], tiles[keep], count)


def per_tile(values: torch.Tensor, tiles: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``values`` of objects in tile order (``tiles``: each one's tile, ascending) as one tensor per tile of the
    ``count`` (torchvision's RoI pooling takes a list)."""
    return list(values.split(torch.bincount(tiles, minlength=count).tolist()))


def top_per_level(scores: torch.Tensor, per_level: list[int], wanted: int) -> torch.Tensor:
    """(B, K): each level's ``wanted`` best candidates (or all of a smaller level) of every tile, as indices into
    ``scores`` (B, candidates of every level, level after level): torchvision's ``pre_nms_top_n`` selection."""
    picks, offset = [], 0
    for level in scores.split(per_level, dim=1):
        picks.append(level.topk(min(wanted, int(level.shape[1])), dim=1).indices + offset)
        offset += int(level.shape[1])
    return torch.cat(picks, dim=1)


def instances_of(model: MaskRCNN, images: torch.Tensor) -> MaskLogits:
    """The network over a batch of tiles (B, C, h, w, float in [0, 1]): proposals, boxes and mask logits."""
    batch = model_input(model.transform, images)
    count = int(images.shape[0])
    feature_maps = model.backbone(batch.images)
    sizes = [batch.resized] * count
    heads = model.roi_heads
    regions = proposals(model, batch, list(feature_maps.values()))
    pooled = heads.box_head(heads.box_roi_pool(feature_maps, regions, sizes))
    class_logits, regressions = heads.box_predictor(pooled)
    classes = int(class_logits.shape[-1])
    boxes = clip_boxes_to_image(heads.box_coder.decode(regressions, regions), batch.resized)  # (R, C, 4)
    scores = torch.softmax(class_logits, -1)
    tiles = torch.cat([torch.full((len(r),), k, device=images.device) for k, r in enumerate(regions)])
    labels = torch.arange(classes, device=images.device).expand_as(scores)
    boxes, scores, labels = boxes[:, 1:].reshape(-1, 4), scores[:, 1:].reshape(-1), labels[:, 1:].reshape(-1)
    tiles = tiles[:, None].expand(-1, classes - 1).reshape(-1)
    keep = torch.where(scores > heads.score_thresh)[0]
    keep = keep[remove_small_boxes(boxes[keep], min_size=EMPTY_BOX)]
    kept = nms_by_group(boxes[keep], scores[keep], tiles[keep] * classes + labels[keep], heads.nms_thresh)
    keep = keep[first_of_each_tile(kept, tiles[keep], heads.detections_per_img)]
    boxes, scores, labels, tiles = boxes[keep], scores[keep], labels[keep], tiles[keep]
    found = per_tile(boxes, tiles, count)
    logits = mask_logits(model, heads.mask_roi_pool(feature_maps, found, sizes))
    logits = logits[torch.arange(len(labels), device=labels.device), labels]
    # 0-based labels outside, as the segmenter gives them (torchvision's class 0 is its background)
    return MaskLogits(boxes, scores, labels - 1, tiles, logits, batch, count, model.mask_threshold)


def mask_logits(model: MaskRCNN, pooled: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """The mask head and predictor over the instances' pooled features (N, C, M, M): (N, classes, 2M, 2M). Its N is
    the batch's count of instances, which differs from batch to batch, and cuDNN's autotuning (a GPU rank's
    ``benchmark``) times its kernels anew for each new shape: there (``step`` None) N is padded with zero regions
    to a multiple of :data:`MASK_ROWS_STEP`, a few dozen shapes for a whole job, and the padding cut off again (a
    region's logits are its own: the head has no normalization across regions)."""
    if step is None:
        step = MASK_ROWS_STEP if pooled.is_cuda and torch.backends.cudnn.benchmark else 1
    count = int(pooled.shape[0])
    rows = -(-count // step) * step
    if rows > count:
        pooled = torch.cat([pooled, pooled.new_zeros((rows - count, *pooled.shape[1:]))])
    heads = model.roi_heads
    return heads.mask_predictor(heads.mask_head(pooled))[:count]


def paste_masks(probabilities: torch.Tensor, boxes: torch.Tensor, size: Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Each mask (N, M, M) in its box (N, 4, the image's pixels) of an image of ``size``, as torchvision's
    ``paste_masks_in_image`` puts it (padded by :data:`MASK_PADDING`, the box widened to match and cut to whole
    pixels, bilinear without corner alignment), every mask at once, but only where it can be non-zero: each mask's
    crop of the image (its widened box, cut to the image) from its origin (N, 2: column, row), as (N, h, w) at the
    batch's largest crop, zero beyond each mask's own. A crown is a small part of its tile: what the merge needs of
    a batch's masks takes a fraction of the tile-sized masks' memory, on the device and in the copy to the host."""
    count, side = probabilities.shape[0], probabilities.shape[-1] + 2 * MASK_PADDING
    if count == 0:
        return probabilities.new_zeros((0, 0, 0)), torch.zeros((0, 2), dtype=torch.int64, device=boxes.device)
    padded = torch.nn.functional.pad(probabilities, (MASK_PADDING,) * 4)
    scale = side / (side - 2 * MASK_PADDING)
    half = (boxes[:, 2:] - boxes[:, :2]) * 0.5 * scale
    centre = (boxes[:, 2:] + boxes[:, :2]) * 0.5
    corner = torch.cat([centre - half, centre + half], dim=1).to(torch.int64)  # x0, y0, x1, y1 (truncated)
    extent = (corner[:, 2:] - corner[:, :2] + 1).clamp(min=1)  # w, h
    limits = torch.tensor([size[1], size[0]], device=boxes.device)
    origins = torch.minimum(corner[:, :2].clamp(min=0), limits)  # each crop's first column and row
    stops = torch.minimum((corner[:, :2] + extent).clamp(min=0), limits)
    crop_width, crop_height = (int(length) for length in (stops - origins).amax(dim=0).tolist())
    rows = interpolation(corner[:, 1], extent[:, 1], side, origins[:, 1], crop_height, size[0], padded.dtype)
    columns = interpolation(corner[:, 0], extent[:, 0], side, origins[:, 0], crop_width, size[1], padded.dtype)
    with torch.autocast(boxes.device.type, enabled=False):  # autocast would multiply in bf16 (or fp16)
        return rows @ padded @ columns.transpose(1, 2), origins


def interpolation(
    start: torch.Tensor,
    extent: torch.Tensor,
    side: int,
    offset: torch.Tensor,
    length: int,
    limit: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(N, length, side): the weights of a bilinear resize (align_corners False, as torch's upsample computes them)
    of ``side`` source pixels to ``extent`` pixels placed from ``start`` along an axis of ``limit`` pixels, at
    ``length`` pixels of it from ``offset``; pixels outside [start, start + extent) or beyond ``limit`` are zero."""
    pixel = offset[:, None] + torch.arange(length, device=start.device)[None, :]  # (N, length): along the axis
    position = pixel - start[:, None]
    inside = (position >= 0) & (position < extent[:, None]) & (pixel < limit)
    scale = (torch.full_like(extent, side, dtype=torch.float32) / extent.to(torch.float32))[:, None]
    source = (scale * (position.to(torch.float32) + 0.5) - 0.5).clamp(min=0.0)
    first = source.to(torch.int64).clamp(max=side - 1)
    step = (first < side - 1).to(torch.int64)
    upper = (source - first.to(torch.float32)).clamp(0.0, 1.0)
    weights = torch.zeros((*position.shape, side), dtype=torch.float32, device=start.device)
    weights.scatter_add_(2, first[..., None], (1.0 - upper)[..., None])
    weights.scatter_add_(2, (first + step)[..., None], upper[..., None])
    return (weights * inside[..., None]).to(dtype)


def pasted_instances(raw: MaskLogits, probabilities: bool = False) -> BatchInstances:
    """The batch's instances in tile pixels, their masks pasted into their crops of their tiles
    (:func:`paste_masks`) and thresholded at the model's ``mask_threshold`` into uint8 0/1 (``probabilities``:
    float32 instead)."""
    boxes = to_tile_pixels(raw.boxes, raw.input)
    masks, origins = paste_masks(torch.sigmoid(raw.logits.float()), boxes, raw.input.tile)
    masks = masks if probabilities else (masks >= raw.threshold).to(torch.uint8)
    return BatchInstances(
        tiles=raw.tiles,
        count=raw.count,
        boxes=boxes.float(),
        scores=raw.scores.float(),
        labels=raw.labels,
        masks=masks,
        origins=origins,
    )


def tile_masks(found: BatchInstances, size: Size) -> torch.Tensor:
    """The instances' masks (N, h, w) at their tiles' ``size``: each crop put at its origin, zero elsewhere."""
    masks = found.masks.new_zeros((len(found.masks), *size))
    for index, ((column, row), crop) in enumerate(zip(found.origins.tolist(), found.masks, strict=True)):
        height, width = min(crop.shape[0], size[0] - row), min(crop.shape[1], size[1] - column)
        masks[index, row : row + height, column : column + width] = crop[:height, :width]
    return masks
