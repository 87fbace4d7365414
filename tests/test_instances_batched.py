"""The batched Mask R-CNN (rasterscale.tasks.instances.batched) gives torchvision's own per-image results on a CPU
in fp32: the same boxes, scores and labels tile by tile, and the same masks but at pixels within float rounding of
the threshold, for native tiles and a resize, with an empty tile amid others, a full cap and a short last batch.
Its masks are crops of their tiles, and give the polygons that the tile-sized masks give."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torchvision.ops import box_iou

from rasterscale.grid.tile import Tile
from rasterscale.raster.bands import InputBands
from rasterscale.tasks.detectors.model import prepare_for_inference
from rasterscale.tasks.instances.batched import (
    BatchInstances,
    instances_of,
    mask_logits,
    pasted_instances,
    tile_masks,
)
from rasterscale.tasks.instances.model import build_instance_model, instances_on_device, instances_to_host
from rasterscale.tasks.instances.modelfiles import InstanceConfig
from rasterscale.tasks.instances.polygons import tile_instances

ROUNDING = 1e-5  # mask probabilities' agreement (the paste's interpolation sums in another order)


def segmenter(resize: tuple[int, int] | None, cap: int) -> torch.nn.Module:
    """An untrained Mask R-CNN (ResNet-18, 2 classes), seeded, its proposal network's head and its box predictor
    drawn as a trained network's (He's initialization: objectness and class scores spread from 0 to 1, not all
    within 1e-2 of a half, where equal scores make the order of the NMS's ties decide): instances on every textured
    tile."""
    torch.manual_seed(0)
    cfg = InstanceConfig(
        backbone="resnet18",
        labels=("tree", "snag"),
        patch_size=96,
        fpn_channels=32,
        score_threshold=0.5,
        detections_per_tile=cap,
        resize=resize,
    )
    model = build_instance_model(cfg)
    with torch.no_grad():
        for layer in (*model.rpn.head.modules(), model.roi_heads.box_predictor.cls_score, model.roi_heads.box_head.fc7):
            if isinstance(layer, torch.nn.Conv2d | torch.nn.Linear):
                torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    return prepare_for_inference(model, channels_last=False)


def tiles(count: int, size: int = 96, seed: int = 1) -> torch.Tensor:
    """Textured tiles in [0, 1]; the second one flat, of the model's mean colour (none of its proposals' class
    scores past the threshold: an empty tile amid others)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.nn.functional.avg_pool2d(torch.rand((count, 3, size, size), generator=generator), 5, 1, 2)
    if count > 1:
        images[1] = torch.tensor(InputBands().mean)[:, None, None]
    return images


def torchvision_instances(model: torch.nn.Module, images: torch.Tensor) -> BatchInstances:
    with torch.inference_mode():
        return instances_on_device(model(list(images)), model.mask_threshold, probabilities=True)


def batched_instances(model: torch.nn.Module, images: torch.Tensor) -> BatchInstances:
    with torch.inference_mode():
        return pasted_instances(instances_of(model, images), probabilities=True)


def whole_tiles(found: BatchInstances, size: tuple[int, int]) -> BatchInstances:
    """The instances with their masks at their tiles' size (the crops put at their origins)."""
    return replace(found, masks=tile_masks(found, size), origins=torch.zeros_like(found.origins))


def assert_same(expected: BatchInstances, got: BatchInstances, threshold: float) -> int:
    """Tile by tile, each of torchvision's instances matched by one of the batch's of its label at box IoU >= 0.99
    (the same count), its score within 1e-4 and its mask's probabilities within :data:`ROUNDING` (so the thresholded
    masks equal but where a probability is that close to ``threshold``); returns the instances compared."""
    assert got.count == expected.count
    compared = 0
    for tile, (want, have) in enumerate(zip(instances_to_host(expected), instances_to_host(got), strict=True)):
        assert len(have["boxes"]) == len(want["boxes"]), f"tile {tile}: {len(have['boxes'])}, not {len(want['boxes'])}"
        if not len(have["boxes"]):
            continue
        iou = box_iou(torch.from_numpy(want["boxes"]), torch.from_numpy(have["boxes"]))
        iou[torch.from_numpy(want["labels"])[:, None] != torch.from_numpy(have["labels"])[None, :]] = 0.0
        best = iou.max(dim=1)
        assert (best.values >= 0.99).all(), f"tile {tile}: IoU {best.values.min():.4f}"
        matched = best.indices.numpy()
        assert len(set(matched.tolist())) == len(matched)
        assert np.allclose(have["scores"][matched], want["scores"], atol=1e-4)
        theirs, ours = want["masks"], have["masks"][matched]
        assert np.abs(ours - theirs).max() <= ROUNDING
        differ = (ours >= threshold) != (theirs >= threshold)
        assert (np.abs(theirs[differ] - threshold) <= ROUNDING).all()
        compared += len(matched)
    return compared


@pytest.mark.parametrize(
    ("resize", "batch", "cap"),
    [(None, 4, 100), ((192, 320), 3, 100), (None, 3, 4)],
    ids=["native tiles", "resized (96 -> 192 px), a batch of 3", "a full cap of 4, a batch of 3"],
)
def test_batched_mask_rcnn_gives_torchvisions_instances(resize, batch, cap):
    model = segmenter(resize, cap)
    images = tiles(batch)
    size = (images.shape[-2], images.shape[-1])
    expected, crops = torchvision_instances(model, images), batched_instances(model, images)
    got = whole_tiles(crops, size)
    counts = [int((expected.tiles == k).sum()) for k in range(batch)]
    assert counts[1] == 0 and min(counts[:1] + counts[2:]) > 0, counts  # an empty tile amid others
    assert assert_same(expected, got, model.mask_threshold) >= min(20, cap + 1), counts
    if cap < 100:
        assert max(counts) == cap  # the cap is reached
    assert got.masks.shape[-2:] == images.shape[-2:]  # masks at the tile's size, whatever the resize
    assert crops.masks.shape[-2] <= size[0] and crops.masks.shape[-1] <= size[1]  # the crops: at most the tile
    short = images[: batch - 1]  # the last batch of a rank, shorter than the rest
    short_crops = batched_instances(model, short)
    assert_same(torchvision_instances(model, short), whole_tiles(short_crops, size), model.mask_threshold)


def test_runs_of_tiles_keep_their_places_and_masks_are_thresholded_on_the_device():
    model = segmenter(None, 100)
    images = tiles(4)
    expected = torchvision_instances(model, images)
    with torch.inference_mode():
        raw = instances_of(model, images)
    crops, binary = pasted_instances(raw, probabilities=True), pasted_instances(raw)
    assert binary.masks.dtype == torch.uint8 and set(binary.masks.unique().tolist()) <= {0, 1}
    assert torch.equal(binary.masks, (crops.masks >= model.mask_threshold).to(torch.uint8))
    got = whole_tiles(crops, (96, 96))
    assert_same(expected[0:1], got[0:1], model.mask_threshold)  # a batch cut where the scene changes
    assert_same(expected[1:4], got[1:4], model.mask_threshold)


def test_the_masks_crops_give_the_polygons_of_the_tile_sized_masks():
    """What the merge gets of a batch's masks (each one's crop of its tile, from its origin: here 27 x 63 px of the
    96 x 96 tiles) traces the same polygons as the masks pasted into whole tiles, on tiles inside the raster and at
    its corner (test_instances_merge checks the cut instances of crops at the tiles' edges)."""
    model = segmenter(None, 100)
    images = tiles(4)
    with torch.inference_mode():
        crops = pasted_instances(instances_of(model, images))
    whole = whole_tiles(crops, (96, 96))
    compared = 0
    for k, (crop, full) in enumerate(zip(instances_to_host(crops), instances_to_host(whole), strict=True)):
        for tile in (Tile(k, 96 * (k + 1), 80, 96, 96), Tile(k, 0, 0, 96, 96)):
            args = (tile, 2000, 2000, model.mask_threshold)
            ours = tile_instances(crop["masks"], crop["scores"], crop["labels"], *args, crop["origins"])
            theirs = tile_instances(full["masks"], full["scores"], full["labels"], *args)
            assert len(ours.polygons) == len(theirs.polygons)
            assert all(a.equals_exact(b, 0.0) for a, b in zip(ours.polygons, theirs.polygons, strict=True))
            assert ours.cut.tolist() == theirs.cut.tolist() and ours.scores.tolist() == theirs.scores.tolist()
            compared += len(ours.polygons)
    assert compared >= 20
    assert crops.masks.numel() * 4 < whole.masks.numel()  # the crops: a fraction of the tiles' pixels


def test_a_bf16_rank_decodes_boxes_and_pastes_masks_in_float32():
    """Under autocast (a bf16-mixed rank) the box predictor and the paste compute in fp32, as they do without it:
    torchvision decodes boxes in the dtype of their regressions (bf16: steps of 4 px at 800 px), and the masks are
    placed by those boxes and multiplied into their crops by a matrix product autocast would take to bf16."""
    model = segmenter(None, 100)
    images = tiles(4)
    predictor = model.roi_heads.box_predictor
    pooled = torch.rand((8, predictor.cls_score.in_features), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        plain = predictor(pooled)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = predictor(pooled)
            raw = instances_of(model, images)
            crops = pasted_instances(raw, probabilities=True)
        again = pasted_instances(raw, probabilities=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, mixed, strict=True))
    assert raw.boxes.dtype == torch.float32 and crops.masks.dtype == torch.float32 and len(crops.masks) > 0
    assert torch.equal(crops.masks, again.masks)
    assert len(instances_to_host(crops)) == len(images)


@pytest.mark.parametrize("count", [0, 5, 64, 70])
def test_the_mask_heads_regions_padded_to_a_step_give_each_region_its_own_logits(count):
    """A GPU rank pads the mask head's regions to a multiple of 64 (one of a few shapes for cuDNN's autotuning):
    the padding changes no region's logits, and comes off again."""
    model = segmenter(None, 100)
    pooled = torch.rand((count, 32, 14, 14), generator=torch.Generator().manual_seed(count))
    with torch.inference_mode():
        plain = mask_logits(model, pooled, step=1)
        padded = mask_logits(model, pooled, step=64)
        default = mask_logits(model, pooled)  # a CPU rank: not padded
    assert plain.shape == padded.shape == (count, 3, 28, 28)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-6)
    assert torch.equal(default, plain)


def test_a_batch_leaves_the_device_in_two_copies_and_each_tile_gets_its_own_instances():
    """instances_to_host copies the packed boxes, scores, labels, origins and tiles, then the masks: each tile's
    arrays are its rows of the device tensors, exactly, the empty tile's empty, labels and origins int64."""
    model = segmenter(None, 100)
    found = batched_instances(model, tiles(4))
    host = instances_to_host(found)
    assert (
        len(host) == 4 and len(host[1]["boxes"]) == 0 and sum(len(tile["boxes"]) for tile in host) == len(found.boxes)
    )
    for k, tile in enumerate(host):
        rows = found.tiles == k
        for key in ("boxes", "scores", "labels", "masks", "origins"):
            np.testing.assert_array_equal(tile[key], getattr(found, key)[rows].numpy(), err_msg=key)
        assert tile["labels"].dtype == np.int64 and tile["origins"].dtype == np.int64
