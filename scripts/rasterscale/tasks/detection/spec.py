"""Detection's spec (torch-free): boxes of objects into a vector layer per scene (GeoPackage and GeoParquet), merged
across tiles and scored with precision, recall, F1 and mAP@0.5 (:func:`rasterscale.tasks.detectors.spec.objects_spec`
says what it shares with instances)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rasterscale.raster.headers import RasterInfo
from rasterscale.scene import Scene
from rasterscale.settings import Settings
from rasterscale.tasks.detection.groundtruth import read_annotations
from rasterscale.tasks.detection.merge import merge_scene
from rasterscale.tasks.detection.metrics import evaluate_scene
from rasterscale.tasks.detection.modelfiles import detector_of_config
from rasterscale.tasks.detection.project import merge_project
from rasterscale.tasks.detection.quicklook import render_detections_quicklook, scored_boxes
from rasterscale.tasks.detectors.spec import ObjectLayer, objects_spec


def evaluate(
    scene: Scene, settings: Settings, labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    return evaluate_scene(
        scene.outputs["parquet"],
        scene.raster,
        scene.annotations,
        list(labels),
        scene.label_column or None,
        settings.evaluate,
        out,
        quicklook,
        scene.image_path,
    )


def check_annotations(path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str) -> None:
    read_annotations(path, raster, labels, label_column, image)


def scored(scene: Scene, min_score: float) -> np.ndarray:
    return scored_boxes(scene.outputs["parquet"], min_score)


DETECTION = objects_spec(
    "detection",
    ObjectLayer(
        layer="detections",
        shapes="boxes",
        ap_name="map50",
        of_config=detector_of_config,
        merge_scene=merge_scene,
        scored=scored,
        render_quicklook=render_detections_quicklook,
    ),
    model_keys=(),
    evaluate_keys=("iou_threshold", "score_threshold"),
    default_model_name="detector",
    check_annotations=check_annotations,
    evaluate=evaluate,
    merge_project=merge_project,
    implementation="rasterscale.tasks.detection.task:DetectionTask",
)
