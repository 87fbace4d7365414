"""Model files in and out: every format rasterscale reads (written here as DeepForest writes them), the effective
configuration (config keys over the file), the input scale, fine-tuning starts and the DeepForest folder export."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from torchvision.ops.misc import FrozenBatchNorm2d

from deepforest_files import (
    released_state_dict,
    torchvision_retinanet,
    write_folder,
    write_lightning_checkpoint,
)
from prediction import PredictScene, predict_rank_file
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import Settings, settings_of
from rasterscale.tasks.detection.model import build_detector, init_from_model_file, load_detector, save_detector
from rasterscale.tasks.detection.modelfiles import (
    DEEPFOREST_RESIZE,
    DetectorConfig,
    read_header,
    resolve_detector,
    write_deepforest_folder,
)
from rasterscale.tasks.detectors.model import freeze_pretrained_backbone, load_backbone_weights, load_weights


def settled(raw: dict) -> Settings:
    """The typed settings of a raw config (validated)."""
    return settings_of(validate_config(raw))


@pytest.fixture(scope="module")
def reference():
    """A plain torchvision RetinaNet (resnet18, default transform: min_size 800, max_size 1333), nearly every
    anchor kept so that there are boxes to compare."""
    return torchvision_retinanet(score_thresh=0.0, nms_thresh=0.5, detections_per_img=100)


@pytest.fixture(scope="module")
def tile():
    return torch.from_numpy(np.random.default_rng(1).integers(0, 255, (3, 256, 256), dtype=np.uint8)).float() / 255


def same_weights(model: torch.nn.Module, reference: torch.nn.Module, skip: str = "") -> bool:
    mine = model.state_dict()
    return all(torch.equal(mine[k], v) for k, v in reference.state_dict().items() if not (skip and k.startswith(skip)))


def predict(model: torch.nn.Module, tile: torch.Tensor) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        return {k: v.numpy() for k, v in model.eval()([tile])[0].items()}


# --- each format ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "model."])
def test_deepforest_folder_with_or_without_the_model_prefix(tmp_path, reference, prefix):
    folder = write_folder(tmp_path / "tree", reference, {"Tree": 0}, score_thresh=0.5, nms_thresh=0.05, prefix=prefix)
    header = read_header(folder)
    assert (header.kind, header.backbone, header.num_classes, header.labels) == (
        "DeepForest folder",
        "resnet18",
        1,
        ("Tree",),
    )
    assert (header.score_threshold, header.nms_threshold, header.resize) == (0.5, 0.05, DEEPFOREST_RESIZE)
    model, cfg, _ = load_detector(folder)
    assert same_weights(model, reference)
    assert (cfg.labels, cfg.score_threshold, cfg.nms_threshold, cfg.resize) == (("Tree",), 0.5, 0.05, (800, 1333))


def test_deepforest_lightning_checkpoint(tmp_path, reference):
    path = write_lightning_checkpoint(tmp_path / "deepforest.ckpt", reference, {"Tree": 0})
    header = read_header(path)
    assert (header.kind, header.labels, header.score_threshold, header.resize) == (
        "DeepForest Lightning checkpoint",
        ("Tree",),
        0.1,
        DEEPFOREST_RESIZE,
    )
    assert same_weights(load_detector(path)[0], reference)


@pytest.mark.parametrize("zipfile", [True, False])
def test_legacy_deepforest_state_dict(tmp_path, reference, zipfile):
    path = tmp_path / "NEON.pt"
    torch.save(released_state_dict(reference), path, _use_new_zipfile_serialization=zipfile)
    header = read_header(path)
    assert (header.kind, header.labels, header.num_classes, header.resize) == (
        "DeepForest state dict",
        None,
        1,
        DEEPFOREST_RESIZE,
    )
    model, cfg, _ = load_detector(path)
    assert cfg.labels == ("tree",) and same_weights(model, reference)


def test_rasterscale_model_file_keeps_native_scale(tmp_path):
    cfg = DetectorConfig(backbone="resnet18", labels=("tree", "snag"), patch_size=256, nms_threshold=0.3)
    save_detector(build_detector(cfg), cfg, tmp_path / "model.pt", steps=3)
    header = read_header(tmp_path / "model.pt")
    assert (header.kind, header.labels, header.resize, header.meta) == (
        "rasterscale model file",
        ("tree", "snag"),
        None,
        {"steps": 3},
    )
    assert load_detector(tmp_path / "model.pt")[1] == cfg


def test_a_lighter_feature_pyramid_is_read_from_the_weights_and_round_trips(tmp_path, reference):
    """model.fpn_channels: a 128-channel pyramid and head (about 4x cheaper) are built, saved and read back from
    the weights' shapes; DeepForest's files have torchvision's 256; a config that contradicts a file fails."""
    cfg = DetectorConfig(backbone="resnet18", patch_size=256, fpn_channels=128)
    model = build_detector(cfg)
    assert model.backbone.out_channels == 128 and model.head.classification_head.conv[0][0].out_channels == 128

    def pyramid_and_head(detector: torch.nn.Module) -> int:
        return sum(p.numel() for name, p in detector.named_parameters() if not name.startswith("backbone.body."))

    full = build_detector(DetectorConfig(backbone="resnet18"))
    assert pyramid_and_head(model) < 0.3 * pyramid_and_head(full)
    save_detector(model, cfg, tmp_path / "light.pt")
    header = read_header(tmp_path / "light.pt")
    assert header.fpn_channels == 128
    loaded, loaded_cfg, _ = load_detector(tmp_path / "light.pt")
    assert loaded_cfg == cfg and same_weights(loaded, model)
    deepforest = read_header(write_folder(tmp_path / "tree", reference))
    assert deepforest.fpn_channels == 256 and resolve_detector(settled({}), deepforest).fpn_channels == 256
    with pytest.raises(ConfigError, match=r"'model.fpn_channels' is 128 but .*tree has a 256-channel feature pyramid"):
        resolve_detector(settled({"model": {"fpn_channels": 128}}), deepforest)
    assert resolve_detector(settled({"model": {"fpn_channels": 128}}), None).fpn_channels == 128
    with pytest.raises(ConfigError, match=r"'model\.fpn_channels' applies to task detection and instances only"):
        validate_config({"task": "segmentation", "model": {"fpn_channels": 128}})


def test_what_is_not_a_model_file_fails_in_one_line_naming_it(tmp_path, reference):
    (tmp_path / "notes.txt").write_text("not a model")
    torch.save({"anything": 1}, tmp_path / "other.pt")
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "linear.pt")
    write_folder(tmp_path / "half", reference)
    (tmp_path / "half/model.safetensors").unlink()
    write_folder(tmp_path / "classes", reference, {"Tree": 0, "Bird": 1})
    cases = {
        "notes.txt": "notes.txt: not a model file rasterscale reads",
        "other.pt": "other.pt: not a model file rasterscale reads",
        "linear.pt": r"linear.pt: not a model file .* not a torchvision RetinaNet",
        "half": "half: a DeepForest model folder needs config.json and model.safetensors; missing model.safetensors",
        "classes": r"classes/config.json: num_classes 2 but the weights have 1 classes",
        "missing": "missing: model file not found",
    }
    for name, message in cases.items():
        with pytest.raises(InputError, match=message) as caught:
            read_header(tmp_path / name)
        assert "\n" not in str(caught.value)


# --- the effective configuration --------------------------------------------------------------------------------


def test_config_keys_override_the_file_and_null_keys_take_it(tmp_path, reference):
    header = read_header(write_folder(tmp_path / "tree", reference, score_thresh=0.5, nms_thresh=0.05))
    config = settled({"model": {"nms_threshold": 0.2, "detections_per_tile": 50, "resize": "native"}})
    cfg = resolve_detector(config, header)
    assert (cfg.labels, cfg.score_threshold, cfg.nms_threshold, cfg.detections_per_tile, cfg.resize) == (
        ("Tree",),
        0.5,
        0.2,
        50,
        None,
    )
    assert resolve_detector(settled({}), None) == DetectorConfig()  # no file: rasterscale's defaults
    sized = settled({"model": {"resize": {"min_size": 600, "max_size": 1000}}})
    assert resolve_detector(sized, None).resize == (600, 1000)


def test_labels_or_backbone_that_contradict_the_file_fail_at_resolution(tmp_path, reference):
    header = read_header(write_folder(tmp_path / "tree", reference))
    with pytest.raises(ConfigError, match=r"'model.labels' names 2 classes but .*tree has 1: Tree"):
        resolve_detector(settled({"model": {"labels": ["a", "b"]}}), header)
    with pytest.raises(ConfigError, match=r"'model.backbone' is resnet50 but .*tree is a resnet18"):
        resolve_detector(settled({"model": {"backbone": "resnet50"}}), header)
    # a starting point for training: other labels are fine (they get a new class head)
    assert resolve_detector(settled({"model": {"labels": ["a", "b"]}}), header, new_head=True).labels == (
        "a",
        "b",
    )


def test_changed_nms_and_detections_per_tile_change_prediction(tmp_path):
    scene = PredictScene.make(tmp_path / "scene")

    def boxes_per_tile(name: str, **model: float) -> np.ndarray:
        frame = pq.read_table(predict_rank_file(scene, tmp_path / name, workers=0, model=model)).to_pandas()
        return frame.groupby("tile_id").size().to_numpy()

    default = boxes_per_tile("default")
    assert default.max() > 5
    assert boxes_per_tile("five", detections_per_tile=5).max() == 5
    assert boxes_per_tile("loose", nms_threshold=0.9).sum() > default.sum()


# --- input scale ------------------------------------------------------------------------------------------------


def test_deepforest_model_predicts_as_torchvision_retinanet_with_its_default_resize(tmp_path, reference, tile):
    folder = write_folder(tmp_path / "tree", reference, score_thresh=0.0, nms_thresh=0.5)
    model, cfg, _ = load_detector(folder, settled({"model": {"detections_per_tile": 100}}))
    assert cfg.resize == (800, 1333)
    ours, theirs = predict(model, tile), predict(reference, tile)
    assert len(theirs["boxes"]) == 100
    np.testing.assert_allclose(ours["boxes"], theirs["boxes"], atol=1e-3)
    np.testing.assert_allclose(ours["scores"], theirs["scores"], atol=1e-5)
    assert ours["boxes"].max() <= 256  # in tile pixels, not the resized image's
    # at native scale the same weights see the tile at its own size: other boxes
    native = predict(
        load_detector(folder, settled({"model": {"resize": "native", "detections_per_tile": 100}}))[0], tile
    )
    assert not np.allclose(native["boxes"], theirs["boxes"], atol=1)


def test_native_scale_leaves_tiles_at_their_size(tile):
    model = build_detector(DetectorConfig(backbone="resnet18", patch_size=256))
    images, _ = model.transform([tile])
    assert images.image_sizes == [(256, 256)]
    model = build_detector(DetectorConfig(backbone="resnet18", patch_size=256, resize=(800, 1333)))
    assert model.transform([tile])[0].image_sizes == [(800, 800)]


# --- fine-tuning starts -----------------------------------------------------------------------------------------


def test_init_with_the_files_classes_loads_every_weight(tmp_path, reference):
    folder = write_folder(tmp_path / "tree", reference)
    cfg = resolve_detector(settled({"model": {"labels": ["tree"]}}), read_header(folder), new_head=True)
    model = build_detector(cfg)
    message = init_from_model_file(model, cfg, folder)
    assert message.startswith("all weights from") and same_weights(model, reference)


def test_init_with_other_labels_replaces_the_last_class_layer_only(tmp_path, reference):
    folder = write_folder(tmp_path / "tree", reference)
    cfg = resolve_detector(settled({"model": {"labels": ["oak", "pine"]}}), read_header(folder), new_head=True)
    model = build_detector(cfg)
    message = init_from_model_file(model, cfg, folder)
    assert "except the class head's last layer, new for 2 class(es) oak, pine" in message
    assert same_weights(model, reference, skip="head.classification_head.cls_logits.")
    assert model.head.classification_head.cls_logits.weight.shape[0] == 9 * 2
    assert cfg.resize == DEEPFOREST_RESIZE  # the init model's input scale carries over to training


def test_backbone_weights_load_into_the_backbone_only(tmp_path):
    from torchvision.models import resnet18

    torch.manual_seed(3)
    weights = resnet18(weights=None).state_dict()  # torchvision's ImageNet layout, fc included
    torch.save(weights, tmp_path / "resnet18.pth")
    model = build_detector(DetectorConfig(backbone="resnet18"))
    message = load_backbone_weights(model, tmp_path / "resnet18.pth", InputBands())
    assert "backbone from the ImageNet weights" in message
    body = model.backbone.body.state_dict()
    assert all(torch.equal(body[k], v) for k, v in weights.items() if not k.startswith("fc."))
    torch.save(resnet18(weights=None).fc.state_dict(), tmp_path / "fc.pth")
    with pytest.raises(InputError, match=r"fc.pth: not a torchvision ResNet state dict"):
        load_backbone_weights(model, tmp_path / "fc.pth", InputBands())


# --- out: the DeepForest folder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("resize", [None, (800, 1333)])
def test_written_folder_reads_back_and_predicts_the_same(tmp_path, tile, resize):
    cfg = DetectorConfig(backbone="resnet18", labels=("tree",), patch_size=256, score_threshold=0.0, resize=resize)
    torch.manual_seed(0)
    model = build_detector(cfg).eval()
    folder = write_deepforest_folder(model.state_dict(), cfg, tmp_path / "models/tiny")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]  # no temporary left behind
    config = json.loads((folder / "config.json").read_text())
    assert config["label_dict"] == {"tree": 0} and config["num_classes"] == 1
    assert (config["min_size"], config["max_size"]) == (resize or (256, 256))  # DeepForest runs it at this scale
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        assert not [k for k in handle.keys() if "num_batches_tracked" in k or k.startswith("model.")]  # noqa: SIM118
    again, cfg_again, _ = load_detector(folder)
    assert cfg_again == cfg
    ours, theirs = predict(again, tile), predict(model, tile)
    np.testing.assert_allclose(ours["boxes"], theirs["boxes"], atol=1e-4)
    write_deepforest_folder(model.state_dict(), cfg, folder)  # rewriting replaces it whole
    assert load_detector(folder)[1] == cfg


def test_a_pretrained_backbone_is_fine_tuned_with_frozen_norms_and_stem(tmp_path, tile):
    cfg = DetectorConfig(backbone="resnet18", patch_size=256)
    model = build_detector(cfg).train()
    model.backbone(tile[None])  # batch statistics: the norms now hold trained running statistics
    model.eval()
    expected = model.backbone(tile[None])["0"]
    assert "batch norms frozen (20), conv1 and layer1 fixed" in freeze_pretrained_backbone(model)
    model.train()  # frozen norms keep their statistics in training mode
    torch.testing.assert_close(model.backbone(tile[None])["0"], expected)
    body = dict(model.backbone.body.named_parameters())
    assert not body["conv1.weight"].requires_grad and not body["layer1.0.conv1.weight"].requires_grad
    assert body["layer2.0.conv1.weight"].requires_grad
    again = build_detector(cfg)  # what prediction builds: the frozen model's weights load into it
    load_weights(again, model.state_dict(), "frozen")
    torch.testing.assert_close(again.eval().backbone(tile[None])["0"], expected)


def test_an_untrained_backbone_is_not_frozen():
    """A model file that was never trained (batch norms at mean 0, variance 1) starts training whole."""
    model = build_detector(DetectorConfig(backbone="resnet18", patch_size=256))
    assert "no trained statistics" in freeze_pretrained_backbone(model)
    assert all(p.requires_grad for p in model.backbone.body.parameters())
    assert not any(isinstance(m, FrozenBatchNorm2d) for m in model.modules())
