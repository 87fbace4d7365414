"""Segmentation: a class per pixel with a segmentation-models-pytorch network, one COG of classes per scene (with
its probabilities and its polygons).

Each rank blends its tiles' class probabilities with weights that taper toward inner tile edges and writes the
classes of its own tiles' cores (:mod:`rasterscale.tasks.segmentation.blend`: memory flat however large the raster); the
merge assembles the cores into ``classes.tif`` (:mod:`rasterscale.tasks.segmentation.merge`). The library is
:mod:`rasterscale.tasks.segmentation`; this module is what the core asks of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec
from rasterscale.scene import Scene
from rasterscale.settings import PredictSettings, Settings
from rasterscale.tasks.api import SizedDataset, TrainingModule, model_device
from rasterscale.tasks.dense import DenseTask, DenseTileDataset, collate_stack, prepare_dense_for_inference
from rasterscale.tasks.exported.card import ModelCard
from rasterscale.tasks.exported.resolve import exported_model
from rasterscale.tasks.exported.runtime import ExportedDense
from rasterscale.tasks.inputlayer import adapt_state_dict, and_then
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.blend import TileBlender
from rasterscale.tasks.segmentation.dataset import SegmentationTileDataset
from rasterscale.tasks.segmentation.groundtruth import read_segmentation_truth
from rasterscale.tasks.segmentation.metrics import confusion_matrix, iou_scores
from rasterscale.tasks.segmentation.model import (
    Segmenter,
    build_segmenter,
    load_segmenter,
    save_segmenter,
    start_encoder,
)
from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig
from rasterscale.tasks.segmentation.spec import CARD, SEGMENTATION, segmentation_model


class SegmentationTrainingModule(TrainingModule):
    def losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, masks = batch
        logits = self.model(images)
        return {"cross_entropy": torch.nn.functional.cross_entropy(logits, masks, ignore_index=NODATA_CLASS)}


def validate_segmenter(model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
    """mIoU and pixel accuracy on the validation tiles (rank 0 only: no collectives)."""

    was_training, device = model.training, model_device(model)
    model.eval()
    confusion: np.ndarray | None = None
    with torch.inference_mode():
        for dataset in datasets:
            for start in range(0, len(dataset), batch_size):
                images, masks = collate_stack([dataset[i] for i in range(start, min(len(dataset), start + batch_size))])
                logits = model(images.to(device))
                classes = logits.argmax(1).to(torch.uint8).cpu().numpy()
                part = confusion_matrix(classes, masks.numpy(), logits.shape[1])
                confusion = part if confusion is None else confusion + part
    model.train(was_training)
    if confusion is None:
        return {}
    scores = iou_scores(confusion, [str(k) for k in range(len(confusion))])
    return {"val_miou": float(scores["miou"]), "val_pixel_accuracy": float(scores["pixel_accuracy"])}


class SegmentationTask(DenseTask):
    spec = SEGMENTATION
    training_module_class = SegmentationTrainingModule
    blender = TileBlender
    blended = "classes"

    def model_config(self, settings: Settings) -> SegmenterConfig | ModelCard:
        return segmentation_model(settings, check=False)

    def build_model(self, model_cfg: SegmenterConfig) -> torch.nn.Module:
        return build_segmenter(model_cfg)

    def load_model(self, path: str | Path, settings: Settings) -> tuple[torch.nn.Module, SegmenterConfig | ModelCard]:
        exported = exported_model(path, settings, CARD)
        if exported is not None:
            return exported
        model, cfg, _ = load_segmenter(path, settings.model.labels)
        return model, cfg

    def start_encoder(self, model: torch.nn.Module, model_cfg: SegmenterConfig, path: str) -> str:
        return start_encoder(model, model_cfg, path)

    def start_from(self, model: torch.nn.Module, model_cfg: SegmenterConfig, init: str) -> str:
        """Start from ``init``, a rasterscale segmenter of the same classes and network (all its weights)."""
        start, start_cfg, _ = load_segmenter(init, model_cfg.labels)
        state, adapted = adapt_state_dict(start.state_dict(), model_cfg.input, start_cfg.input)
        model.load_state_dict(state)
        return f"all weights from {init} ({start_cfg.describe()}){and_then(adapted)}"

    def tile_samples(
        self, scene: Scene, model_cfg: SegmenterConfig, spec: ImageSpec
    ) -> Callable[[Sequence[Tile]], DenseTileDataset]:
        truth = read_segmentation_truth(scene.annotations, scene.raster, model_cfg.labels, scene.label_column)
        return functools.partial(SegmentationTileDataset, scene.raster, spec=spec, truth=truth)

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_segmenter(model, datasets, batch_size)

    def save_model(
        self, model: torch.nn.Module, model_cfg: SegmenterConfig, model_path: str | Path, **meta: Any
    ) -> list[Path]:

        save_segmenter(model, model_cfg, model_path, **meta)
        return [Path(model_path)]

    def prepare_for_inference(self, model: torch.nn.Module, predict: PredictSettings) -> torch.nn.Module:
        if isinstance(model, ExportedDense):
            return model.prepare(predict.channels_last)
        return prepare_dense_for_inference(model, cast(Segmenter, model).net, predict.channels_last)

    def postprocess(self, raw: torch.Tensor) -> torch.Tensor:
        """The class probabilities (softmax of the logits, in fp32)."""
        return torch.softmax(raw.float(), dim=1)

    def blended_bands(self, model_cfg: SegmenterConfig | ModelCard) -> int:
        return model_cfg.num_classes

    def blend_options(self, settings: Settings) -> dict[str, Any]:
        """Whether the rank rasters hold the probabilities too (``predict.probabilities``)."""
        return {"probabilities": settings.predict.probabilities}
