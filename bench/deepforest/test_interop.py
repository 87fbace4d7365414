"""rasterscale <-> DeepForest model files, checked against DeepForest itself. Runs in DeepForest's own environment
(DeepForest 2.1.0 is not in rasterscale's pins), from the repository root:

    .venv-deepforest/bin/python -m pytest bench/deepforest/test_interop.py -q

- a folder DeepForest writes (``RetinaNetHub.save_pretrained``) and its Lightning ``.ckpt`` load in rasterscale
  and predict the boxes DeepForest predicts on the same tile;
- a folder rasterscale writes (:func:`rasterscale.tasks.detection.modelfiles.write_deepforest_folder`, as training
  writes ``results/models/{name}/``) loads with ``RetinaNetHub.from_pretrained`` and through ``deepforest.main`` and
  predicts there what rasterscale predicts, at the input scale the model records.

No download: ``RetinaNetHub(backbone_weights=None)`` still asks torchvision for ImageNet backbone weights, so
``retinanet_resnet50_fpn`` is patched to ``weights_backbone=None`` (any hub-free use of DeepForest needs that).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from rasterscale.config.schema import validate_config
from rasterscale.settings import settings_of
from rasterscale.tasks.detection.model import build_detector, load_detector
from rasterscale.tasks.detection.modelfiles import DetectorConfig, read_header, write_deepforest_folder

deepforest = pytest.importorskip("deepforest", reason="runs in DeepForest's environment")
from deepforest.models.retinanet import RetinaNetHub  # noqa: E402

from deepforest import main as deepforest_main  # noqa: E402

SCORE, NMS = 0.005, 0.5  # low: an untrained model's scores sit near torchvision's 0.01 prior


@pytest.fixture(autouse=True)
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = torchvision.models.detection.retinanet_resnet50_fpn

    def offline(*args: object, **kwargs: object) -> torch.nn.Module:
        return builder(*args, **{**kwargs, "weights_backbone": None})

    monkeypatch.setattr(torchvision.models.detection, "retinanet_resnet50_fpn", offline)


@pytest.fixture(scope="module")
def tile() -> np.ndarray:
    """A 400 px uint8 RGB patch (DeepForest's patch size), HWC."""
    return np.random.default_rng(7).integers(0, 255, (400, 400, 3), dtype=np.uint8)


def model_input(tile: np.ndarray) -> torch.Tensor:
    """The tile as both sides feed it: CHW float in [0, 1] (DeepForest divides by 255, rasterscale too)."""
    return torch.from_numpy(tile).permute(2, 0, 1).float() / 255


def predict(model: torch.nn.Module, tile: np.ndarray) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        return {k: v.numpy() for k, v in model.eval()([model_input(tile)])[0].items()}


def assert_same_boxes(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    assert len(theirs["boxes"]) > 10, "too few boxes for a comparison"
    assert len(ours["boxes"]) == len(theirs["boxes"])
    np.testing.assert_allclose(ours["boxes"], theirs["boxes"], atol=1e-2)
    np.testing.assert_allclose(ours["scores"], theirs["scores"], atol=1e-4)


def deepforest_model(**kwargs: object) -> RetinaNetHub:
    torch.manual_seed(0)
    return RetinaNetHub(backbone_weights=None, num_classes=1, label_dict={"Tree": 0}, **kwargs).eval()


def test_deepforest_folder_predicts_in_rasterscale_as_in_deepforest(tmp_path: Path, tile: np.ndarray) -> None:
    theirs = deepforest_model(score_thresh=SCORE, nms_thresh=NMS)
    theirs.save_pretrained(tmp_path / "tree")
    header = read_header(tmp_path / "tree")
    assert (header.kind, header.backbone, header.labels, header.resize) == (
        "DeepForest folder",
        "resnet50",
        ("Tree",),
        (800, 1333),
    )
    model, cfg, _ = load_detector(tmp_path / "tree")  # strict, with the file's thresholds
    assert (cfg.score_threshold, cfg.nms_threshold) == (SCORE, NMS)
    assert_same_boxes(predict(model, tile), predict(theirs, tile))


def test_deepforest_lightning_checkpoint_and_state_dict_load_in_rasterscale(tmp_path: Path, tile: np.ndarray) -> None:
    theirs = deepforest_model(score_thresh=SCORE, nms_thresh=NMS)
    torch.save(theirs.state_dict(), tmp_path / "NEON.pt")
    module = deepforest_main.deepforest(
        model=theirs, config_args={"model": {"name": None}, "label_dict": {"Tree": 0}, "num_classes": 1}
    )
    module.set_labels({"Tree": 0})
    module.create_trainer(logger=False, accelerator="cpu", devices=1)
    module.trainer.strategy.connect(module)
    module.trainer.save_checkpoint(tmp_path / "tree.ckpt")
    overrides = settings_of(validate_config({"model": {"score_threshold": SCORE, "nms_threshold": NMS}}))
    for path in (tmp_path / "tree.ckpt", tmp_path / "NEON.pt"):
        model, cfg, _ = load_detector(path, overrides)
        assert cfg.resize == (800, 1333)
        assert_same_boxes(predict(model, tile), predict(theirs, tile))
    assert read_header(tmp_path / "tree.ckpt").labels == ("Tree",)


@pytest.mark.parametrize("resize", [(800, 1333), None])
def test_rasterscale_folder_loads_and_predicts_in_deepforest(
    tmp_path: Path, tile: np.ndarray, resize: tuple[int, int] | None
) -> None:
    cfg = DetectorConfig(labels=("Tree",), patch_size=400, score_threshold=SCORE, nms_threshold=NMS, resize=resize)
    torch.manual_seed(1)
    ours = build_detector(cfg).eval()
    folder = write_deepforest_folder(ours.state_dict(), cfg, tmp_path / "models/crowns")
    theirs = RetinaNetHub.from_pretrained(folder).eval()
    assert theirs.label_dict == {"Tree": 0} and theirs.num_classes == 1
    assert (theirs.transform.min_size[0], theirs.transform.max_size) == (resize or (400, 400))
    expected = predict(ours, tile)
    assert_same_boxes(predict(theirs, tile), expected)
    # as a DeepForest user loads it: deepforest.main with the folder as its model name, thresholds of its config
    user = deepforest_main.deepforest(
        config_args={"model": {"name": str(folder)}, "score_thresh": SCORE, "nms_thresh": NMS, "accelerator": "cpu"}
    )
    frame = user.predict_image(image=tile.astype("float32"))
    assert list(frame["label"].unique()) == ["Tree"]
    boxes = frame[["xmin", "ymin", "xmax", "ymax"]].to_numpy(float)
    assert len(boxes) == len(expected["boxes"])
    np.testing.assert_allclose(boxes, expected["boxes"], atol=1e-2)
