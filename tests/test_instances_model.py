"""The instance model (rasterscale.tasks.instances.model, .modelfiles): torchvision's Mask R-CNN built on both
backbones and trained a step, DeepForest's Mask R-CNN folders in (written here by a replica of DeepForest's class)
and out (loaded back into that class strictly), headers read without torch, the effective configuration, and the
one-line errors of files that are not instance models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torchvision.models.detection import maskrcnn_resnet50_fpn

from conftest import REPO
from deepforest_files import DeepForestMaskRCNN, torchvision_retinanet, write_deepforest_maskrcnn, write_folder
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import Settings, settings_of
from rasterscale.tasks.detection.model import build_detector, save_detector
from rasterscale.tasks.detection.modelfiles import DetectorConfig
from rasterscale.tasks.detectors.model import load_backbone_weights
from rasterscale.tasks.instances.model import (
    build_instance_model,
    init_from_model_file,
    load_instance_model,
    predict_instances,
    save_instance_model,
)
from rasterscale.tasks.instances.modelfiles import (
    INSTANCES_FORMAT,
    InstanceConfig,
    instances_of_config,
    read_header,
    resolve_instances,
    write_deepforest_maskrcnn_folder,
)

TILE = 128  # px: DeepForest's resnet50 compared at this size, min_size = max_size = the tile (no resampling)
LOSSES = {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
LIGHT = InstanceConfig(backbone="resnet18", labels=("tree", "snag"), patch_size=64, fpn_channels=64)


def settled(raw: dict) -> Settings:
    """The typed settings of an instances config's keys (validated)."""
    return settings_of(validate_config({"task": "instances", **raw}))


@pytest.fixture(scope="module")
def tile() -> torch.Tensor:
    torch.manual_seed(5)
    return torch.rand(3, TILE, TILE)


@pytest.fixture(scope="module")
def deepforest(tmp_path_factory):
    """A folder DeepForest's Mask R-CNN wrote (random weights, seed 0), every box scored, and the model."""
    folder = tmp_path_factory.mktemp("deepforest") / "crowns"
    model = write_deepforest_maskrcnn(
        folder,
        {"Tree": 0, "Snag": 1},
        score_thresh=0.0,
        nms_thresh=0.5,
        min_size=TILE,
        max_size=TILE,
        box_detections_per_img=20,
    )
    return folder, model


@pytest.fixture(scope="module")
def light_file(tmp_path_factory):
    """A rasterscale model file of the light model (resnet18, 64-channel pyramid)."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("light") / "light.pt"
    save_instance_model(build_instance_model(LIGHT), LIGHT, path, steps=3)
    return path


def theirs(model: torch.nn.Module, tile: torch.Tensor) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        return {k: v.numpy() for k, v in model.eval()([tile])[0].items()}


def assert_same_instances(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    """rasterscale's instances (masks as probabilities) are a DeepForest model's, labels after its shift."""
    assert len(reference["boxes"]) == 20 and reference["masks"].shape == (20, 1, TILE, TILE)
    np.testing.assert_allclose(ours["boxes"], reference["boxes"], atol=1e-2)
    np.testing.assert_allclose(ours["scores"], reference["scores"], atol=1e-4)
    np.testing.assert_array_equal(ours["labels"], reference["labels"])
    np.testing.assert_allclose(ours["masks"], reference["masks"][:, 0], atol=1e-2)
    assert (reference["masks"] >= 0.5).any()  # there are mask pixels to compare


def same_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> bool:
    mine = model.state_dict()
    return all(torch.equal(mine[k], v) for k, v in state.items() if not k.startswith(skip))


# --- the network ---------------------------------------------------------------------------------------------


def test_config_round_trip_and_description():
    cfg = InstanceConfig(labels=("tree", "snag"), resize=(800, 1333), mask_threshold=0.6)
    assert InstanceConfig.from_dict(cfg.to_dict()) == cfg and cfg.num_classes == 3
    assert cfg.describe() == (
        "labels tree, snag, FPN 256 channels, resized to min_size 800, max 1333, score 0.3, nms 0.4, mask 0.6, "
        "100 detections per tile"
    )
    for threshold in (1.5, 0.0):
        with pytest.raises(ValueError, match="not a probability above 0"):
            InstanceConfig(mask_threshold=threshold)


@pytest.mark.parametrize(("backbone", "fpn_channels"), [("resnet50", 256), ("resnet18", 128)])
def test_both_backbones_build_and_a_training_step_gives_the_five_losses(backbone, fpn_channels):
    """resnet50 is torchvision's maskrcnn_resnet50_fpn layout exactly; the light model's heads are as wide as its
    pyramid. One training step on a tiny batch with masks (labels 0-based) gives five finite losses."""
    cfg = InstanceConfig(backbone=backbone, labels=("tree", "snag"), patch_size=64, fpn_channels=fpn_channels)
    torch.manual_seed(0)
    model = build_instance_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if fpn_channels == 256:
        with torch.device("meta"):
            reference = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3)
        assert shapes == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    else:
        assert shapes["roi_heads.box_head.fc6.weight"] == (4 * 128, 128 * 7 * 7)
        assert shapes["rpn.head.conv.0.0.weight"] == (128, 128, 3, 3)
        assert shapes["roi_heads.mask_head.3.0.weight"] == (128, 128, 3, 3)
        assert shapes["roi_heads.mask_predictor.mask_fcn_logits.weight"] == (3, 128, 1, 1)
    masks = torch.zeros(2, 64, 64, dtype=torch.uint8)
    masks[0, 8:30, 10:28], masks[1, 36:60, 30:50] = 1, 1
    targets = [{"boxes": torch.tensor([[10.0, 8, 28, 30], [30, 36, 50, 60]]), "labels": torch.tensor([0, 1])}]
    targets[0]["masks"] = masks
    model.train()
    model.roi_heads.fg_bg_sampler.batch_size_per_image = 64  # a tiny step: 64 sampled regions, not 512
    losses = model([torch.rand(3, 64, 64)], targets)
    assert set(losses) == LOSSES and all(torch.isfinite(v) for v in losses.values())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    before = model.roi_heads.mask_predictor.mask_fcn_logits.weight.detach().clone()
    sum(losses.values()).backward()
    optimizer.step()
    assert not torch.equal(before, model.roi_heads.mask_predictor.mask_fcn_logits.weight)


def test_predicted_instances_are_numpy_arrays_in_tile_pixels(light_file):
    tiling = {"patch_size": LIGHT.patch_size, "overlap": 16}  # the file's tiles
    keys = {"model": {"score_threshold": 0.0, "detections_per_tile": 10}, "tiling": tiling}
    model, cfg, meta = load_instance_model(light_file, settled(keys))
    assert meta == {"steps": 3} and (cfg.score_threshold, cfg.detections_per_tile) == (0.0, 10)
    with pytest.raises(ValueError, match="eval mode"):
        predict_instances(model.train(), [torch.rand(3, 64, 64)])
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    binary, soft = (predict_instances(model.eval(), images, probabilities=p) for p in (False, True))
    assert len(binary) == 2
    out = binary[0]
    n = len(out["boxes"])
    assert 0 < n <= cfg.detections_per_tile  # score 0: every box the per-class NMS keeps, up to the limit
    assert out["boxes"].dtype == np.float32 and out["boxes"].shape == (n, 4) and out["boxes"].max() <= 64
    assert out["scores"].dtype == np.float32 and out["labels"].dtype == np.int64
    assert set(out["labels"]) <= {0, 1}  # 0-based: tree, snag
    assert out["masks"].dtype == np.uint8 and out["masks"].shape == (n, 64, 64)
    assert soft[0]["masks"].dtype == np.float32
    np.testing.assert_array_equal(out["masks"], soft[0]["masks"] >= cfg.mask_threshold)


# --- DeepForest's Mask R-CNN folders, in and out -------------------------------------------------------------


def test_a_deepforest_folder_predicts_what_deepforest_predicts(deepforest, tile):
    folder, reference = deepforest
    header = read_header(folder)
    assert (header.kind, header.backbone, header.fpn_channels, header.num_classes, header.labels) == (
        "DeepForest folder",
        "resnet50",
        256,
        2,
        ("Tree", "Snag"),
    )
    assert (header.score_threshold, header.nms_threshold, header.detections_per_tile, header.resize) == (
        0.0,
        0.5,
        20,
        (TILE, TILE),
    )
    model, cfg, _ = load_instance_model(folder)  # strict but for batch-norm step counters, which it has none of
    assert (cfg.labels, cfg.resize, cfg.detections_per_tile) == (("Tree", "Snag"), (TILE, TILE), 20)
    assert same_weights(model, reference.state_dict())
    ours = predict_instances(model.eval(), [tile], probabilities=True)[0]
    assert_same_instances(ours, theirs(reference, tile))
    assert ours["labels"].max() <= 1  # 0-based, as DeepForest returns them


def test_a_folder_rasterscale_writes_loads_strictly_into_deepforests_class(deepforest, tile, tmp_path):
    """config.json's keys are the arguments DeepForest's __init__ takes; the weights load with strict=True and the
    model predicts what rasterscale's does (here at native scale: DeepForest's min_size = max_size = the patch)."""
    cfg = InstanceConfig(
        labels=("tree", "snag"), patch_size=TILE, score_threshold=0.0, nms_threshold=0.5, detections_per_tile=20
    )
    model = build_instance_model(cfg).eval()
    model.load_state_dict(deepforest[1].state_dict(), strict=False)  # trained-like batch norms
    folder = write_deepforest_maskrcnn_folder(model.state_dict(), cfg, tmp_path / "models/crowns")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in folder.parent.iterdir()] == ["crowns"]  # no temporary left behind
    config = json.loads((folder / "config.json").read_text())
    assert config == {
        "label_dict": {"tree": 0, "snag": 1},
        "num_classes": 2,
        "score_thresh": 0.0,
        "nms_thresh": 0.5,
        "box_detections_per_img": 20,
        "min_size": TILE,
        "max_size": TILE,
    }
    replica = DeepForestMaskRCNN(**config).eval()
    replica.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    assert_same_instances(predict_instances(model, [tile], probabilities=True)[0], theirs(replica, tile))
    assert load_instance_model(folder)[1] == cfg  # backbone, native scale, patch size, mask threshold kept
    write_deepforest_maskrcnn_folder(model.state_dict(), cfg, folder)  # rewriting replaces it whole
    assert read_header(folder).labels == ("tree", "snag")


# --- headers and the effective configuration -----------------------------------------------------------------


def test_headers_of_both_formats_are_read_without_torch(deepforest, light_file):
    script = (
        "import json, sys\n"
        "from rasterscale.tasks.instances.modelfiles import read_header\n"
        "headers = [read_header(path) for path in sys.argv[1:]]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(json.dumps([[h.kind, h.backbone, h.fpn_channels, list(h.labels), h.meta] for h in headers]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    result = subprocess.run(
        [sys.executable, "-c", script, str(deepforest[0]), str(light_file)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == [
        ["DeepForest folder", "resnet50", 256, ["Tree", "Snag"], {}],
        ["rasterscale model file", "resnet18", 64, ["tree", "snag"], {"steps": 3}],
    ]


def test_config_keys_override_the_file_and_defaults_fill_the_rest(deepforest):
    header = read_header(deepforest[0])
    config = {"model": {"nms_threshold": 0.2, "mask_threshold": 0.7, "resize": "native"}, "tiling": {"patch_size": 96}}
    cfg = resolve_instances(settled(config), header)
    assert (cfg.labels, cfg.score_threshold, cfg.nms_threshold, cfg.mask_threshold, cfg.resize, cfg.patch_size) == (
        ("Tree", "Snag"),
        0.0,
        0.2,
        0.7,
        None,
        96,
    )
    assert resolve_instances(settled({}), None) == InstanceConfig()  # no file: rasterscale's defaults
    assert instances_of_config(settled({"model": {"file": str(deepforest[0])}}))[0].detections_per_tile == 20
    with pytest.raises(ConfigError, match=r"'model.labels' names 1 classes but .*crowns has 2: Tree, Snag"):
        resolve_instances(settled({"model": {"labels": ["tree"]}}), header)
    with pytest.raises(ConfigError, match=r"'model.backbone' is resnet18 but .*crowns is a resnet50"):
        resolve_instances(settled({"model": {"backbone": "resnet18"}}), header)
    # a starting point for training: other labels get new class layers
    init = instances_of_config(settled({"model": {"labels": ["oak"]}, "train": {"init": str(deepforest[0])}}))[0]
    assert init.labels == ("oak",) and init.resize == (TILE, TILE)


def test_init_with_other_labels_keeps_all_but_the_class_layers(light_file):
    state = torch.load(light_file, weights_only=True)["state_dict"]
    same = build_instance_model(LIGHT)
    assert init_from_model_file(same, LIGHT, light_file).startswith("all weights from")
    assert same_weights(same, state)
    other = InstanceConfig.from_dict({**LIGHT.to_dict(), "labels": ("oak", "pine", "birch")})
    model = build_instance_model(other)
    message = init_from_model_file(model, other, light_file)
    assert "except the box and mask predictors' class layers, new for 3 class(es) oak, pine, birch" in message
    assert same_weights(model, state, skip=("roi_heads.box_predictor.", "roi_heads.mask_predictor.mask_fcn_logits."))
    assert model.roi_heads.box_predictor.cls_score.out_features == 4


def test_backbone_weights_start_the_resnet_only(tmp_path):
    """model.backbone_weights: a torchvision ImageNet ResNet state dict (here random) starts the backbone."""
    from torchvision.models import resnet18

    torch.manual_seed(3)
    weights = resnet18(weights=None).state_dict()
    torch.save(weights, tmp_path / "resnet18.pth")
    model = build_instance_model(LIGHT)
    assert "backbone from the ImageNet weights" in load_backbone_weights(model, tmp_path / "resnet18.pth", InputBands())
    body = model.backbone.body.state_dict()
    assert all(torch.equal(body[k], v) for k, v in weights.items() if not k.startswith("fc."))


# --- what is not an instance model ---------------------------------------------------------------------------


def test_what_is_not_an_instance_model_fails_in_one_line_naming_it(tmp_path, light_file):
    detector = DetectorConfig(backbone="resnet18", patch_size=64, fpn_channels=32)
    save_detector(build_detector(detector), detector, tmp_path / "d.pt")
    write_folder(tmp_path / "retinanet", torchvision_retinanet())
    segmenter = {"format": "rasterscale-segmenter/1", "task": "segmentation", "model": {"architecture": "unet"}}
    torch.save(segmenter, tmp_path / "s.pt")
    light = load_instance_model(light_file)[0]
    for name, config in {
        "half": None,
        "labels": {"num_classes": 2, "label_dict": {"tree": 0, "snag": 1, "oak": 2}},
    }.items():
        write_deepforest_maskrcnn_folder(light.state_dict(), LIGHT, tmp_path / name)
        if config:
            (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "half/model.safetensors").unlink()
    write_deepforest_maskrcnn_folder(light.state_dict(), LIGHT, tmp_path / "classes")
    (tmp_path / "classes/config.json").write_text(json.dumps({"num_classes": 3}))
    torch.save(light.state_dict(), tmp_path / "bare.pt", _use_new_zipfile_serialization=False)  # read with torch
    (tmp_path / "notes.txt").write_text("not a model")
    cases = {
        "d.pt": r"d.pt: a detection model \(resnet18\), but task is instances \(set task: detection, or give an ",
        "retinanet": r"retinanet: a RetinaNet's weights \(boxes only: a model of task detection\), but task is inst",
        "s.pt": r"s.pt: a segmentation model \(unet\), but task is instances",
        "half": "half: a DeepForest model folder needs config.json and model.safetensors; missing model.safetensors",
        "labels": r"labels/config.json: label_dict \{'tree': 0, 'snag': 1, 'oak': 2\} does not number the weights' 2",
        "classes": "classes/config.json: num_classes 3 but the weights have 2 classes",
        "bare.pt": "bare.pt: not an instance segmentation model file .* bare Mask R-CNN weights",
        "notes.txt": "notes.txt: not an instance segmentation model file rasterscale reads",
        "missing": "missing: model file not found",
        "half/config.json": r"config.json: give the DeepForest model folder \(.*half\), not one of its files",
    }
    for name, message in cases.items():
        with pytest.raises(InputError, match=message) as caught:
            read_header(tmp_path / name)
        assert "\n" not in str(caught.value)
    assert read_header(light_file).kind == "rasterscale model file" and INSTANCES_FORMAT.endswith("/1")


def test_validation_matches_masks_one_to_one_by_iou():
    """The validation scores' mask IoU: of every predicted mask with every true one; a prediction matches the true
    mask of its class it overlaps most, once (here the better-scoring of two predictions of one crown takes it)."""
    from rasterscale.tasks.detectors.metrics import greedy_match
    from rasterscale.tasks.instances.task import mask_ious

    truth = np.zeros((2, 8, 8), dtype=np.uint8)
    truth[0, :4, :4] = 1  # 16 px
    truth[1, 4:, 4:] = 1
    predicted = np.zeros((3, 8, 8), dtype=np.uint8)
    predicted[0, :4, :2] = 1  # half of the first crown: IoU 0.5
    predicted[1, :4, :4] = 1  # the first crown exactly
    predicted[2, 4:, 4:6] = 1  # half of the second: IoU 0.5
    ious = mask_ious(predicted, truth)
    np.testing.assert_allclose(ious, [[0.5, 0.0], [1.0, 0.0], [0.0, 0.5]])
    pred_idx, gt_idx = np.nonzero(ious > 0)
    match = greedy_match(pred_idx, gt_idx, ious[pred_idx, gt_idx], np.array([0.9, 0.8, 0.7]), 2, 0.5)
    assert match.tolist() == [0, -1, 1]  # the first prediction scores higher: it takes crown 0 at IoU 0.5
