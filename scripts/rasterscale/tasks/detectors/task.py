"""The torch half of the tasks whose models are torchvision detectors on a ResNet-FPN backbone (detection's
RetinaNet, instances' Mask R-CNN): the model built, loaded and described from the functions of a task's ``model``
and ``modelfiles`` (:class:`DetectorModel`), a training step on images and their targets, batches as lists, the
start from a model file or an ImageNet backbone, the model saved with a DeepForest folder beside it, inference's
fast path, and a rank's objects of a scene as one GeoParquet file (:mod:`rasterscale.tasks.detectors.rankoutput`).
Each task adds its training samples, its validation and what a batch's results are."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from rasterscale.datasets.sampling import FlippableSamples
from rasterscale.datasets.tiles import collate_lists
from rasterscale.grid.tile import Tile
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.raster.imagery import ImageSpec
from rasterscale.scene import Scene
from rasterscale.settings import PredictSettings, Settings, TrainSettings
from rasterscale.tasks.api import PredictScene, RankOutput, SizedDataset, Task, TrainingModule
from rasterscale.tasks.detectors.model import freeze_pretrained_backbone, load_backbone_weights, prepare_for_inference
from rasterscale.tasks.detectors.modelfiles import ResNetFPNConfig, deepforest_folder_note, deepforest_folder_of
from rasterscale.tasks.detectors.rankoutput import ObjectsRankOutput
from rasterscale.tasks.spec import Part

if TYPE_CHECKING:
    from torchvision.models.detection import MaskRCNN, RetinaNet


LOGGER = logging.getLogger("rasterscale.train")


@dataclass(frozen=True)
class DetectorModel:
    """A detector task's model: what the logs call its network (``"RetinaNet"``) and the model (``"the
    detector"``), the DeepForest class its model folder loads into, and the functions of the task's ``model`` and
    ``modelfiles``: the effective configuration of a config (and the header of the file it names), a fresh model,
    a model file's model (with its configuration and metadata), a model file's weights loaded into a model (what,
    for the log), the rasterscale model file written, and the DeepForest model folder written."""

    network: str
    called: str
    deepforest_class: str
    of_config: Callable[[Settings], tuple[ResNetFPNConfig, Any]]
    build: Callable[[Any], torch.nn.Module]
    load: Callable[[str | Path, Settings], tuple[torch.nn.Module, Any, Any]]
    init_from_file: Callable[[Any, Any, str | Path], str]
    save: Callable[..., None]
    write_folder: Callable[[Mapping[str, Any], Any, str | Path], Path]


class DetectorTrainingModule(TrainingModule):
    """A torchvision detector's losses: the model's own, in training mode, on a batch of (images, targets)."""

    def losses(self, batch: tuple[list, list]) -> dict[str, torch.Tensor]:
        images, targets = batch
        return self.model(images, targets)


class DetectorTask(Task):
    """What a task whose model is a torchvision detector on a ResNet-FPN backbone inherits: everything but its
    ground truth and training samples (:meth:`read_truth`, :meth:`tile_samples`), :meth:`validate` and
    :meth:`predict_batch`, from its ``detector`` (:class:`DetectorModel`) and its rank output's class."""

    training_module_class = DetectorTrainingModule
    detector: ClassVar[DetectorModel]
    rank_output_class: ClassVar[type[ObjectsRankOutput]]

    def model_config(self, settings: Settings) -> Any:
        return self.detector.of_config(settings)[0]

    def describe(self, model_cfg: Any) -> str:
        return f"{self.detector.network} {model_cfg.backbone}, {model_cfg.describe()}"

    def build_model(self, model_cfg: Any) -> torch.nn.Module:
        return self.detector.build(model_cfg)  # its transform resizes as the model records (model.resize)

    def load_model(self, path: str | Path, settings: Settings) -> tuple[torch.nn.Module, Any]:
        model, cfg, _ = self.detector.load(path, settings)
        return model, cfg

    def initial_weights(self, model: torch.nn.Module, model_cfg: Any, settings: Settings) -> str:
        """Start the model from ``train.init`` (a model file), or its backbone from ``model.backbone_weights`` (a
        torchvision ImageNet ResNet), or from scratch. A pretrained backbone is fine-tuned as DeepForest does
        (frozen batch norms and stem)."""
        net = cast("RetinaNet | MaskRCNN", model)
        init, backbone_weights = settings.train.init, settings.model.backbone_weights
        if init:
            loaded = self.detector.init_from_file(net, model_cfg, init)
        elif backbone_weights:
            loaded = load_backbone_weights(net, backbone_weights, model_cfg.input, f"{self.detector.called}'s backbone")
            loaded += ", the rest initialized at random"
        else:
            return "no weights: training from scratch (random initialization)"
        adapted = "first convolution adapted" in loaded  # its new bands' filters must learn: conv1 not fixed
        return f"{loaded}; {freeze_pretrained_backbone(net, fix_first_conv=not adapted)}"

    @staticmethod
    @abstractmethod
    def read_truth(
        path: str | Path, raster: RasterInfo, labels: list[str], label_column: str | None, image: str | None, /
    ) -> Any:
        """A scene's ground truth, its objects in the raster's pixels (the task's ``groundtruth`` reader)."""

    @abstractmethod
    def tile_samples(
        self, raster: str, truth: Any, spec: ImageSpec, min_visible_fraction: float
    ) -> Callable[[Sequence[Tile]], Any]:
        """The samples of a scene's tiles (given when called): each tile of ``raster`` with the objects of
        ``truth`` it holds enough of."""

    def training_datasets(
        self,
        scene: Scene,
        model_cfg: Any,
        train: Sequence[Tile],
        validation: Sequence[Tile],
        spec: ImageSpec,
        train_settings: TrainSettings,
    ) -> tuple[FlippableSamples, SizedDataset | None]:
        """A scene's samples of its training and validation tiles, its ground truth read once for both."""
        raster = check_raster(scene.raster)
        labels = list(model_cfg.labels)
        truth = self.read_truth(scene.annotations, raster, labels, scene.label_column, scene.image_path)
        samples = self.tile_samples(scene.raster, truth, spec, train_settings.min_visible_fraction)
        return samples(train), (samples(validation) if validation else None)

    def collate(self, batch: list[Any]) -> Any:
        return collate_lists(batch)

    def save_model(
        self, model: torch.nn.Module, model_cfg: ResNetFPNConfig, model_path: str | Path, **meta: Any
    ) -> list[Path]:
        """The rasterscale model file and, beside it, the same model as a DeepForest model folder."""
        folder = deepforest_folder_of(model_path)
        self.detector.save(model, model_cfg, Path(model_path), **meta)
        self.detector.write_folder(model.state_dict(), model_cfg, folder)
        note = deepforest_folder_note(folder, self.detector.deepforest_class, model_cfg)
        if note:
            LOGGER.warning(note)
        return [Path(model_path), folder]

    def prepare_for_inference(self, model: torch.nn.Module, predict: PredictSettings) -> torch.nn.Module:
        return prepare_for_inference(model, channels_last=predict.channels_last)

    def rank_output(
        self,
        scene: PredictScene,
        own: Sequence[Tile],
        predicted: Sequence[Tile],
        path: str | Path,
        model_cfg: Any,
        settings: Settings,
        parts: Sequence[Part] | None = None,
        device: torch.device | None = None,
    ) -> RankOutput:
        return self.rank_output_class.of_model(scene, model_cfg, path, parts or ())
