"""The batched RetinaNet (rasterscale.tasks.detection.batched) gives torchvision's own per-image results on a CPU
in fp32: the same boxes, scores and labels, tile by tile, for native tiles and DeepForest's resize, with empty
tiles, a full cap and a last batch shorter than the rest."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.ops import batched_nms, box_iou

from rasterscale.raster.bands import InputBands
from rasterscale.tasks.detection.batched import Anchors, BatchDetections, head_outputs, select_detections
from rasterscale.tasks.detection.model import build_detector
from rasterscale.tasks.detection.modelfiles import DetectorConfig
from rasterscale.tasks.detection.rankoutput import detections_to_host
from rasterscale.tasks.detectors.batching import group_runs, nms_by_group
from rasterscale.tasks.detectors.model import prepare_for_inference

LABELS = ("tree", "snag")


def detector(resize: tuple[int, int] | None, score: float, cap: int, nms: float = 0.4) -> torch.nn.Module:
    """An untrained RetinaNet (ResNet-18, 2 classes), seeded, its heads' convolutions drawn as a trained network's
    (He's initialization, not torchvision's std 0.01, whose scores all sit at sigmoid(bias)): scores from 0.5 to
    0.99 on textured tiles, hundreds of candidates past 0.6 on the finest levels, their boxes overlapping."""
    torch.manual_seed(0)
    cfg = DetectorConfig(
        backbone="resnet18",
        labels=LABELS,
        patch_size=96,
        score_threshold=score,
        nms_threshold=nms,
        detections_per_tile=cap,
        fpn_channels=32,
        resize=resize,
    )
    model = build_detector(cfg)
    with torch.no_grad():
        for conv in model.head.modules():
            if isinstance(conv, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
                torch.nn.init.zeros_(conv.bias)
        model.head.regression_head.bbox_reg.weight.mul_(0.05)  # boxes near their anchors: overlapping
    return prepare_for_inference(model, channels_last=False)


def tiles(count: int, size: int = 96, seed: int = 1) -> torch.Tensor:
    """Textured tiles in [0, 1]; the second one flat, of the model's mean colour (its input all zeros: scores about
    0.5, none past the threshold, an empty tile amid others)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand((count, 3, size, size), generator=generator)
    images = torch.nn.functional.avg_pool2d(images, 5, stride=1, padding=2)
    if count > 1:
        images[1] = torch.tensor(InputBands().mean)[:, None, None]
    return images


def torchvision_detections(model: torch.nn.Module, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    with torch.inference_mode():
        return model(list(images))


def batched_detections(model: torch.nn.Module, images: torch.Tensor) -> BatchDetections:
    with torch.inference_mode():
        return select_detections(head_outputs(model, images))


def assert_same(expected: list[dict[str, torch.Tensor]], got: BatchDetections) -> int:
    """Tile by tile, each of torchvision's boxes matched by one of the batch's of its label at IoU >= 0.99 (and the
    same count), with its score within 1e-4; returns the boxes compared."""
    assert got.count == len(expected)
    host = detections_to_host(got)
    assert len(host) == len(expected)
    compared = 0
    for tile, (want, have) in enumerate(zip(expected, host, strict=True)):
        assert len(have.boxes) == len(want["boxes"]), f"tile {tile}: {len(have.boxes)} boxes, not {len(want['boxes'])}"
        if not len(have.boxes):
            continue
        iou = box_iou(want["boxes"], torch.from_numpy(have.boxes))
        iou[want["labels"][:, None] != torch.from_numpy(have.labels)[None, :]] = 0.0  # a box per class: same box
        best = iou.max(dim=1)
        assert (best.values >= 0.99).all(), f"tile {tile}: IoU {best.values.min():.4f}"
        matched = best.indices.numpy()
        assert len(set(matched.tolist())) == len(matched), f"tile {tile}: two boxes matched to one"
        assert np.allclose(have.scores[matched], want["scores"].numpy(), atol=1e-4)
        assert np.array_equal(have.labels[matched], want["labels"].numpy())
        compared += len(matched)
    return compared


@pytest.mark.parametrize(
    ("resize", "batch", "cap"),
    [(None, 4, 300), ((192, 320), 4, 300), (None, 3, 5)],
    ids=["native tiles", "resized as DeepForest (96 -> 192 px)", "a full cap of 5, a batch of 3"],
)
def test_batched_retinanet_gives_torchvisions_boxes_scores_and_labels(resize, batch, cap):
    model = detector(resize, score=0.6, cap=cap)
    images = tiles(batch)
    expected = torchvision_detections(model, images)
    got = batched_detections(model, images)
    compared = assert_same(expected, got)
    counts = [len(e["boxes"]) for e in expected]
    assert counts[1] == 0 and min(counts[:1] + counts[2:]) > 0, counts  # an empty tile amid others
    assert compared >= min(20, 2 * cap), counts  # it compares something: candidates past the threshold, NMS at work
    if cap < 300:
        assert max(counts) == cap  # the cap is reached
    # the last batch of a rank, shorter than the rest: the same as its tiles in a batch of their own
    short = batched_detections(model, images[: batch - 1])
    assert_same(torchvision_detections(model, images[: batch - 1]), short)


def test_tiles_without_detections_and_runs_of_tiles_keep_their_places():
    model = detector(None, score=0.6, cap=300)
    images = tiles(4)
    got = batched_detections(model, images)
    expected = torchvision_detections(model, images)
    empty = detector(None, score=0.999, cap=300)  # nothing past the threshold
    none = batched_detections(empty, images)
    assert none.count == 4 and len(none.boxes) == 0
    assert [len(t.boxes) for t in detections_to_host(none)] == [0, 0, 0, 0]
    # a batch cut where the scene changes: each run's tiles numbered from 0, as the engine hands them over
    assert_same(expected[:1], got[0:1])
    assert_same(expected[1:], got[1:4])


def test_anchors_are_made_once_per_input_size_in_fp32():
    model = detector(None, score=0.6, cap=300)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = head_outputs(model, tiles(2))
        again = head_outputs(model, tiles(3, seed=2))
    assert all(a is b for a, b in zip(first.anchors, again.anchors, strict=True))
    assert all(a.dtype == torch.float32 for a in first.anchors)
    assert len(Anchors.of_model(model).made) == 1
    with torch.inference_mode():
        head_outputs(model, tiles(1, size=128))
    assert len(Anchors.of_model(model).made) == 2


def test_one_nms_over_every_group_keeps_what_an_nms_per_group_keeps():
    """The GPU's single NMS (each group's boxes moved to a cell of their own in float64), run here on the CPU, and
    the NMS per group of the CPU, against torchvision's batched NMS: 40 groups (tiles x classes) of overlapping
    boxes; and a tile's boxes the same wherever the tile is in its batch."""
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand((3000, 2), generator=generator) * 180
    boxes = torch.cat([corners, corners + 8 + torch.rand((3000, 2), generator=generator) * 30], dim=1)
    scores = torch.rand(3000, generator=generator)
    groups = torch.randint(0, 40, (3000,), generator=generator)
    expected = batched_nms(boxes, scores, groups, 0.3)  # past 1,000 boxes: torchvision's NMS per group
    assert 200 < len(expected) < 3000  # boxes suppressed, and kept, in every group
    for one_call in (True, False):
        assert torch.equal(nms_by_group(boxes, scores, groups, 0.3, one_call=one_call), expected), one_call
    # a tile's (group 0's) boxes moved to another place in the batch (group 39): the same kept
    first = groups == 0
    for one_call in (True, False):
        alone = nms_by_group(boxes[first], scores[first], groups[first] + 39, 0.3, one_call=one_call)
        assert torch.equal(alone, nms_by_group(boxes[first], scores[first], groups[first], 0.3, one_call=one_call))


def test_the_gpus_nms_in_runs_of_groups_and_with_a_nan_box_keeps_what_an_nms_per_group_keeps():
    """The GPU's NMS over many groups, cut into runs of whole groups (at most 500 boxes a call here, one group of
    700 alone), keeps what one call and an NMS per group keep; a box with a NaN coordinate (an fp16 overflow) is
    kept and suppresses nothing, without moving every group's cell (NaN in the cells' side: nothing suppressed
    anywhere); equal scores come out in index order."""
    generator = torch.Generator().manual_seed(1)
    groups = torch.cat([torch.randint(0, 12, (2300,), generator=generator), torch.full((700,), 12)])
    corners = torch.rand((3000, 2), generator=generator) * 180
    boxes = torch.cat([corners, corners + 8 + torch.rand((3000, 2), generator=generator) * 30], dim=1)
    scores = torch.rand(3000, generator=generator)
    scores[10:20] = scores[5]  # ties, across groups
    per_group = nms_by_group(boxes, scores, groups, 0.3, one_call=False)
    assert 200 < len(per_group) < 3000
    assert len(group_runs(groups, 500)) > 5 and (12, 13) in group_runs(groups, 500)
    for call_boxes in (500, 100_000):
        assert torch.equal(nms_by_group(boxes, scores, groups, 0.3, one_call=True, call_boxes=call_boxes), per_group)
    tied = per_group[torch.isin(per_group, torch.tensor([5, *range(10, 20)]))]
    assert torch.equal(tied, torch.sort(tied).values)
    broken = boxes.clone()
    broken[7, 2] = float("nan")
    expected = nms_by_group(broken, scores, groups, 0.3, one_call=False)
    assert 7 in expected.tolist() and len(expected) > 200
    for call_boxes in (500, 100_000):
        assert torch.equal(nms_by_group(broken, scores, groups, 0.3, one_call=True, call_boxes=call_boxes), expected)
