"""Detection: boxes with torchvision's RetinaNet (DeepForest's model), one vector layer per scene.

The detector's library lives beside this module, in this folder: ``model`` and ``modelfiles`` (building, model
files, DeepForest's formats), ``merge`` (the cross-tile merge), ``evaluate`` (precision, recall, F1, mAP).
This module is what the core asks of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import geopandas as gpd
import numpy as np
import pandas as pd
import torch

from rasterscale.datasets.sampling import FlippableSamples
from rasterscale.grid.tile import Tile
from rasterscale.raster.geo import pixel_boxes_to_polygons
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import ImageSpec, on_data
from rasterscale.scene import Scene
from rasterscale.tasks.api import PredictScene, RankOutput, SizedDataset
from rasterscale.tasks.detection.annotations import read_annotations
from rasterscale.tasks.detection.dataset import TrainTileDataset
from rasterscale.tasks.detection.evaluate import evaluate_detections
from rasterscale.tasks.detection.merge import empty_detections, write_detections_file
from rasterscale.tasks.detection.model import build_detector, init_from_model_file, load_detector, save_detector
from rasterscale.tasks.detection.modelfiles import (
    DetectorConfig,
    detector_of_config,
    write_deepforest_folder,
)
from rasterscale.tasks.detection.spec import DETECTION
from rasterscale.tasks.detectors import DetectorTask, ObjectsRankOutput
from rasterscale.tasks.spec import Part

if TYPE_CHECKING:
    from torchvision.models.detection import RetinaNet


@dataclass
class TileDetections:
    boxes: np.ndarray  # tile pixels
    scores: np.ndarray
    labels: np.ndarray


def detections_frame(
    tiles: Sequence[tuple[Tile, TileDetections]], labels: Sequence[str], transform: Any, crs: Any
) -> gpd.GeoDataFrame:
    """Tile-pixel detections to raster pixels and CRS polygons, one row per box."""
    rows = [(tile, d) for tile, d in tiles if len(d.boxes)]
    if not rows:
        return empty_detections(crs)
    boxes = np.concatenate([d.boxes.astype(np.float64) + [t.col_off, t.row_off, t.col_off, t.row_off] for t, d in rows])
    frame = pd.DataFrame(
        {
            "tile_id": np.concatenate([np.full(len(d.boxes), t.tile_id, dtype=np.int64) for t, d in rows]),
            "label": np.asarray(labels, dtype=object)[np.concatenate([d.labels for _, d in rows])],
            "score": np.concatenate([d.scores for _, d in rows]).astype(np.float32),
            "px_xmin": boxes[:, 0],
            "px_ymin": boxes[:, 1],
            "px_xmax": boxes[:, 2],
            "px_ymax": boxes[:, 3],
        }
    )
    return gpd.GeoDataFrame(frame, geometry=pixel_boxes_to_polygons(boxes, transform), crs=crs)


class DetectionRankOutput(ObjectsRankOutput):
    """A rank's detections of one scene, as GeoParquet (boxes in raster pixels and CRS polygons)."""

    unit = "detections"
    write_file = staticmethod(write_detections_file)
    empty = staticmethod(empty_detections)

    def add(self, tile: Tile, result: TileDetections) -> None:
        self.results.append((tile, result))

    def frame(self) -> gpd.GeoDataFrame:
        return detections_frame(self.results, self.labels, self.scene.transform, self.scene.crs)

    def held_tile_ids(self) -> list[int]:
        return [tile.tile_id for tile, _ in self.results]


def predict_tiles(model: torch.nn.Module, dataset: TrainTileDataset, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Run the raw detector over a tile dataset (rank 0 only: no collectives)."""
    was_training = model.training
    model.eval()
    outputs: list[dict[str, np.ndarray]] = []
    with torch.inference_mode():
        for start in range(0, len(dataset), batch_size):
            images = [dataset[i][0] for i in range(start, min(len(dataset), start + batch_size))]
            outputs.extend({k: v.float().numpy() for k, v in o.items()} for o in model(images))
    model.train(was_training)
    return outputs


def validate_detector(
    model: torch.nn.Module, datasets: Sequence[TrainTileDataset], batch_size: int
) -> dict[str, float]:
    """Tile-level precision/recall/F1 (IoU 0.4) and mAP@0.5 on the validation tiles."""

    pred_boxes, pred_scores, pred_labels, gt_boxes, gt_labels = [], [], [], [], []
    offset = 0.0
    for dataset in datasets:
        for index, out in enumerate(predict_tiles(model, dataset, batch_size)):
            target = dataset.target(index)
            # place each tile in its own region of a virtual plane so that tiles never match across
            shift = np.array([offset, 0, offset, 0])
            pred_boxes.append(out["boxes"] + shift)
            pred_scores.append(out["scores"])
            pred_labels.append(out["labels"])
            gt_boxes.append(target["boxes"].numpy() + shift)
            gt_labels.append(target["labels"].numpy())
            offset += 1e5
    metrics = evaluate_detections(
        np.concatenate(pred_boxes),
        np.concatenate(pred_scores),
        np.concatenate(pred_labels),
        np.concatenate(gt_boxes),
        np.concatenate(gt_labels),
        iou_threshold=0.4,
        score_threshold=float(cast("RetinaNet", model).score_thresh),  # the task's model: a RetinaNet
    )
    return {f"val_{k}": float(metrics[k]) for k in ("precision", "recall", "f1", "map50")}


class DetectionTask(DetectorTask):
    spec = DETECTION
    deepforest_class = "RetinaNetHub"
    model_name = "the detector"

    def model_config(self, config: Mapping[str, Any]) -> DetectorConfig:
        return detector_of_config(config)[0]

    def describe(self, model_cfg: DetectorConfig) -> str:
        return f"RetinaNet {model_cfg.backbone}, {model_cfg.describe()}"

    def load_model(self, path: str | Path, config: Mapping[str, Any]) -> tuple[torch.nn.Module, DetectorConfig]:
        model, cfg, _ = load_detector(path, config)
        return model, cfg

    def build_model(self, model_cfg: DetectorConfig) -> torch.nn.Module:
        return build_detector(model_cfg)  # its transform resizes as the model records (model.resize)

    def init_from_model_file(self, model: torch.nn.Module, model_cfg: DetectorConfig, path: str | Path) -> str:
        return init_from_model_file(cast("RetinaNet", model), model_cfg, path)

    def write_model_files(
        self, model: torch.nn.Module, model_cfg: DetectorConfig, model_path: Path, folder: Path, **meta: Any
    ) -> None:
        save_detector(model, model_cfg, model_path, **meta)
        write_deepforest_folder(model.state_dict(), model_cfg, folder)

    def training_datasets(
        self,
        scene: Scene,
        model_cfg: DetectorConfig,
        train: Sequence[Tile],
        validation: Sequence[Tile],
        spec: ImageSpec,
        train_cfg: Mapping[str, Any],
    ) -> tuple[FlippableSamples, SizedDataset | None]:
        raster = check_raster(scene.raster)
        truth = read_annotations(
            scene.annotations, raster, list(model_cfg.labels), scene.label_column, scene.image_path
        )
        keep = on_data(scene.raster, spec, truth.boxes)  # boxes on masked pixels: the tiles show none
        common = {
            "boxes": truth.boxes[keep],
            "labels": truth.labels[keep],
            "min_visible_fraction": train_cfg["min_visible_fraction"],
        }
        train_set = TrainTileDataset(scene.raster, train, spec, **common)
        val_set = TrainTileDataset(scene.raster, validation, spec, **common) if validation else None
        return train_set, val_set

    def validate(self, model: torch.nn.Module, datasets: Sequence[SizedDataset], batch_size: int) -> dict[str, float]:
        return validate_detector(model, datasets, batch_size)  # type: ignore[arg-type]

    def predict_batch(self, model: torch.nn.Module, images: list[torch.Tensor]) -> list[TileDetections]:
        return [
            TileDetections(
                out["boxes"].float().cpu().numpy(), out["scores"].float().cpu().numpy(), out["labels"].cpu().numpy()
            )
            for out in model(images)
        ]

    def rank_output(
        self,
        scene: PredictScene,
        own: Sequence[Tile],
        predicted: Sequence[Tile],
        path: str | Path,
        model_cfg: DetectorConfig,
        config: Mapping[str, Any],
        parts: Sequence[Part] | None = None,
    ) -> RankOutput:
        return DetectionRankOutput(scene, model_cfg.labels, path, parts or ())
