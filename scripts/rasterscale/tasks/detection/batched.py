"""RetinaNet over a batch of tiles as one tensor on the device: what torchvision's RetinaNet does image by image
(its transform, its anchors, its post-processing), done once for the whole batch, with the same arithmetic.

- **Pre-processing** (:mod:`rasterscale.tasks.detectors.batching`, shared with Mask R-CNN): the batch normalized
  by the model's mean and std, resized in one bilinear interpolation (torchvision's scale: its ``min_size``,
  ``max_size``; only where the model records a resize, DeepForest's 400 px tiles seen at 800 px) and zero-padded
  to the backbone's multiple of 32, all in one operation each. A batch's tiles share one size (the rank's batches
  never mix tile shapes).
- **Anchors** (:class:`~rasterscale.tasks.detectors.batching.Anchors`): made once per input size and kept for
  every batch, in fp32. torchvision makes them at every call in the features' dtype: under bf16 autocast an 800 px
  anchor grid in steps of 4 px.
- **Post-processing** (:func:`select_detections`): each level's scores past the score threshold, then its top-k
  candidates (``topk_candidates``) of every tile at once; the boxes decoded and clipped for the batch; one
  NMS over the batch (the tile in its key, with the class: one call on a GPU however many boxes,
  :func:`~rasterscale.tasks.detectors.batching.nms_by_group`); then each tile's cap
  (``detections_per_img``). DeepForest's settings keep their meaning: ``score_thresh``, ``nms_thresh``, the cap.

The result (:class:`BatchDetections`) is one tensor per kind for the batch, on the device, tiles in order and each
tile's boxes by score; it leaves the device in one copy (:meth:`BatchDetections.packed`). On a CPU, in fp32, the
boxes, scores and labels are torchvision's (``tests/test_detection_batched.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.models.detection import RetinaNet
from torchvision.models.detection._utils import BoxCoder
from torchvision.ops import clip_boxes_to_image

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

PACKED_COLUMNS = 7  # a packed detection: x0, y0, x1, y1, score, label, tile (labels and tiles exact in fp32)


@dataclass(frozen=True)
class Selection:
    """What a RetinaNet keeps of its candidates: its score threshold, its NMS IoU threshold, its top-k candidates
    per level, its cap per tile, and its box coder."""

    score_thresh: float
    nms_thresh: float
    topk_candidates: int
    detections_per_img: int
    box_coder: BoxCoder

    @classmethod
    def of(cls, model: RetinaNet) -> Selection:
        return cls(
            model.score_thresh, model.nms_thresh, model.topk_candidates, model.detections_per_img, model.box_coder
        )


@dataclass(frozen=True)
class HeadOutputs:
    """The network's output for a batch: each level's class logits (B, HWA, C) and box regressions (B, HWA, 4), the
    anchors of every level (HWA, 4, fp32), the input's sizes, and what the model keeps of it."""

    logits: list[torch.Tensor]
    regressions: list[torch.Tensor]
    anchors: list[torch.Tensor]
    input: ModelInput
    selection: Selection


@dataclass(frozen=True)
class BatchDetections(TileObjects):
    """A batch's detections on its device (:class:`~rasterscale.tasks.detectors.batching.TileObjects`): ``boxes``
    (N, 4, tile pixels), ``scores`` (N), ``labels`` (N, int64)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor

    def packed(self) -> torch.Tensor:
        """(N, :data:`PACKED_COLUMNS`) float32: boxes, score, label and tile of each detection, one tensor to copy."""
        return packed_columns(self.boxes, self.scores, self.labels, self.tiles)


def head_outputs(model: RetinaNet, images: torch.Tensor) -> HeadOutputs:
    """The network over a batch of tiles (B, C, h, w, float in [0, 1]): backbone and heads, split by level, with the
    model's anchors (:meth:`Anchors.of_model`)."""
    batch = model_input(model.transform, images)
    features = list(model.backbone(batch.images).values())
    head = model.head(features)
    sizes = [int(f.shape[-2]) * int(f.shape[-1]) for f in features]
    per_location = head["cls_logits"].shape[1] // sum(sizes)
    counts = [size * per_location for size in sizes]
    grids: list[Size] = [(int(f.shape[-2]), int(f.shape[-1])) for f in features]
    padded: Size = (int(batch.images.shape[-2]), int(batch.images.shape[-1]))
    return HeadOutputs(
        list(head["cls_logits"].split(counts, dim=1)),
        list(head["bbox_regression"].split(counts, dim=1)),
        Anchors.of_model(model).of(padded, grids, images.device),
        batch,
        Selection.of(model),
    )


def select_detections(raw: HeadOutputs) -> BatchDetections:
    """torchvision's RetinaNet post-processing for the whole batch at once (module docstring), boxes in tile
    pixels."""
    model = raw.selection
    count = int(raw.logits[0].shape[0])
    boxes, scores, labels, tiles = [], [], [], []
    for logits, regressions, level_anchors in zip(raw.logits, raw.regressions, raw.anchors, strict=True):
        classes = logits.shape[-1]
        level_scores = torch.sigmoid(logits).flatten(1)  # (B, HWA * C)
        passed = torch.where(level_scores > model.score_thresh, level_scores, -1.0)
        top, index = passed.topk(min(model.topk_candidates, passed.shape[1]), dim=1)
        tile, column = (top > model.score_thresh).nonzero(as_tuple=True)
        index = index[tile, column]
        anchor = torch.div(index, classes, rounding_mode="floor")
        decoded = model.box_coder.decode_single(regressions[tile, anchor], level_anchors[anchor])
        boxes.append(clip_boxes_to_image(decoded, raw.input.resized))
        scores.append(top[tile, column])
        labels.append(index % classes)
        tiles.append(tile)
    all_boxes, all_scores = torch.cat(boxes), torch.cat(scores)
    all_labels, all_tiles = torch.cat(labels), torch.cat(tiles)
    classes = int(raw.logits[0].shape[-1])
    keep = nms_by_group(all_boxes, all_scores, all_tiles * classes + all_labels, model.nms_thresh)
    keep = first_of_each_tile(keep, all_tiles, model.detections_per_img)
    return BatchDetections(
        tiles=all_tiles[keep],
        count=count,
        boxes=to_tile_pixels(all_boxes[keep], raw.input),
        scores=all_scores[keep],
        labels=all_labels[keep],
    )
