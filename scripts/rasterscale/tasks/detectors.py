"""The torch half of the tasks whose models are torchvision detectors on a ResNet-FPN backbone (detection's
RetinaNet, instances' Mask R-CNN): a training step on images and their targets, batches as lists, the start from a
model file or an ImageNet backbone, the model saved with a DeepForest folder beside it, inference's fast path, and
a rank's objects of a scene as one GeoParquet file. Each task says how its model files are written and read (its
``model`` and ``modelfiles``) and what a tile's objects are."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import geopandas as gpd
import pandas as pd
import torch

from rasterscale.datasets.tiles import collate_lists
from rasterscale.tasks.api import PredictScene, RankOutput, Task, TrainingModule
from rasterscale.tasks.modelfiles import ResNetFPNConfig, deepforest_folder_note, deepforest_folder_of
from rasterscale.tasks.resnet_fpn import freeze_pretrained_backbone, load_backbone_weights, prepare_for_inference
from rasterscale.tasks.spec import Part

if TYPE_CHECKING:
    from torchvision.models.detection import MaskRCNN, RetinaNet

LOGGER = logging.getLogger("rasterscale.train")


class DetectorTrainingModule(TrainingModule):
    """A torchvision detector's losses: the model's own, in training mode, on a batch of (images, targets)."""

    def losses(self, batch: tuple[list, list]) -> dict[str, torch.Tensor]:
        images, targets = batch
        return self.model(images, targets)


class DetectorTask(Task):
    """What a task whose model is a torchvision detector on a ResNet-FPN backbone inherits."""

    training_module_class = DetectorTrainingModule
    deepforest_class: ClassVar[str]  # the DeepForest class its model folder loads into
    model_name: ClassVar[str]  # what the logs call the model ("the detector")

    @abstractmethod
    def init_from_model_file(self, model: torch.nn.Module, model_cfg: Any, path: str | Path) -> str:
        """Load a model file's weights into ``model``; what was loaded, for the log."""

    @abstractmethod
    def write_model_files(
        self, model: torch.nn.Module, model_cfg: Any, model_path: Path, folder: Path, **meta: Any
    ) -> None:
        """The rasterscale model file at ``model_path`` and the DeepForest model folder ``folder``."""

    def initial_weights(self, model: torch.nn.Module, model_cfg: Any, config: Mapping[str, Any]) -> str:
        """Start the model from ``train.init`` (a model file), or its backbone from ``model.backbone_weights`` (a
        torchvision ImageNet ResNet), or from scratch. A pretrained backbone is fine-tuned as DeepForest does
        (frozen batch norms and stem)."""
        detector = cast("RetinaNet | MaskRCNN", model)
        init, backbone_weights = config["train"]["init"], config["model"]["backbone_weights"]
        if init:
            loaded = self.init_from_model_file(detector, model_cfg, init)
        elif backbone_weights:
            loaded = load_backbone_weights(detector, backbone_weights, model_cfg.input, f"{self.model_name}'s backbone")
            loaded += ", the rest initialized at random"
        else:
            return "no weights: training from scratch (random initialization)"
        adapted = "first convolution adapted" in loaded  # its new bands' filters must learn: conv1 not fixed
        return f"{loaded}; {freeze_pretrained_backbone(detector, fix_first_conv=not adapted)}"

    def collate(self, batch: list[Any]) -> Any:
        return collate_lists(batch)

    def save_model(
        self, model: torch.nn.Module, model_cfg: ResNetFPNConfig, model_path: str | Path, **meta: Any
    ) -> list[Path]:
        """The rasterscale model file and, beside it, the same model as a DeepForest model folder."""
        folder = deepforest_folder_of(model_path)
        self.write_model_files(model, model_cfg, Path(model_path), folder, **meta)
        note = deepforest_folder_note(folder, self.deepforest_class, model_cfg)
        if note:
            LOGGER.warning(note)
        return [Path(model_path), folder]

    def prepare_for_inference(self, model: torch.nn.Module, predict_cfg: Mapping[str, Any]) -> torch.nn.Module:
        return prepare_for_inference(model, channels_last=predict_cfg["channels_last"])


class ObjectsRankOutput(RankOutput):
    """A rank's objects of one scene, as one GeoParquet file: the parts' rows, then those of the tiles added since,
    in prediction order. A part holds the objects of the tiles added since the previous one. A task says how a
    tile's result is held (:meth:`add`), how the held tiles become a frame (:meth:`frame`) and which ids they have
    (:meth:`held_tile_ids`)."""

    unit: ClassVar[str]  # what the log counts ("detections")

    @staticmethod
    @abstractmethod
    def write_file(frame: gpd.GeoDataFrame, path: str | Path, /) -> None:
        """A frame to a rank file, atomically."""

    @staticmethod
    @abstractmethod
    def empty(crs: Any, /) -> gpd.GeoDataFrame:
        """The frame of no objects, in ``crs``."""

    def __init__(self, scene: PredictScene, labels: Sequence[str], path: str | Path, parts: Sequence[Part] = ()):
        self.scene, self.labels, self.path = scene, list(labels), Path(path)
        self.parts = list(parts)
        self.results: list[Any] = []  # tiles added and not in a part yet

    @abstractmethod
    def frame(self) -> gpd.GeoDataFrame:
        """The objects of the tiles held, in the rank file's columns."""

    @abstractmethod
    def held_tile_ids(self) -> list[int]:
        """The ids of the tiles held, in the order added."""

    def forget_held(self) -> None:
        self.results = []

    def save_part(self, path: Path) -> Part | None:
        if not self.results:
            return None
        self.write_file(self.frame(), path)
        part = Part(path, self.held_tile_ids())
        self.parts.append(part)
        self.forget_held()
        return part

    def write(self) -> str:
        frames = [gpd.read_parquet(part.path) for part in self.parts] + [self.frame()]
        frames = [frame for frame in frames if len(frame)]
        frame = pd.concat(frames, ignore_index=True) if frames else self.empty(self.scene.crs)
        self.write_file(frame, self.path)
        resumed = f" ({len(self.parts)} part(s))" if self.parts else ""
        return f"{len(frame)} {self.unit}{resumed}"
