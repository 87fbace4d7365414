"""Detection's spec (torch-free): boxes of objects into a vector layer per scene (GeoPackage and GeoParquet), merged
across tiles and scored with precision, recall, F1 and mAP@0.5."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rasterscale.raster.bands import InputBands
from rasterscale.raster.headers import RasterInfo
from rasterscale.tasks.detection.annotations import read_annotations
from rasterscale.tasks.detection.evaluate import evaluate_scene
from rasterscale.tasks.detection.merge import count_detections, merge_scene, scored_boxes
from rasterscale.tasks.detection.modelfiles import detector_of_config
from rasterscale.tasks.detection.project import merge_project
from rasterscale.tasks.detection.quicklook import render_quicklook
from rasterscale.tasks.spec import MODEL_FILES_WITH_DEEPFOREST, TaskSpec


def summarize(metrics: Mapping[str, Any]) -> str:
    return (
        f"precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} f1={metrics['f1']:.3f} "
        f"map50={metrics['map50']:.3f}"
    )


def merge(scene: Mapping[str, Any], outputs: Sequence[str], config: Mapping[str, Any]) -> str:
    merged = merge_scene(outputs, scene["manifest"], scene["raster"], scene["gpkg"], scene["parquet"], config["merge"])
    return f"{len(merged)} detections -> {scene['gpkg']}"


def evaluate(
    scene: Mapping[str, Any], config: Mapping[str, Any], labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    return evaluate_scene(
        scene["parquet"],
        scene["raster"],
        scene["annotations"],
        list(labels),
        scene.get("label_column") or None,
        config["evaluate"],
        out,
        quicklook,
        scene.get("image_path"),
    )


def quicklook(scene: Mapping[str, Any], config: Mapping[str, Any], png: str | Path, title: str) -> None:
    """The evaluation's picture without ground truth: the boxes scoring at least evaluate.score_threshold."""
    threshold = config["evaluate"]["score_threshold"]
    boxes = scored_boxes(scene["parquet"], threshold)
    render_quicklook(scene["raster"], boxes, None, png, title=f"{title}: {len(boxes)} boxes of score >= {threshold}")


def counts(scene: Mapping[str, Any], labels: Sequence[str]) -> dict[str, int]:
    return count_detections(scene["parquet"], labels)


def labels(config: Mapping[str, Any]) -> list[str]:
    return list(detector_of_config(config)[0].labels)


def model_input(config: Mapping[str, Any]) -> InputBands:
    return detector_of_config(config)[0].input


def check_annotations(path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str) -> None:
    read_annotations(path, raster, labels, label_column, image)


DETECTION = TaskSpec(
    name="detection",
    rank_suffix=".parquet",
    scene_outputs=lambda config: {"gpkg": "detections.gpkg", "parquet": "detections.parquet"},
    evaluated_output="parquet",
    model_files=MODEL_FILES_WITH_DEEPFOREST,
    default_model_name="detector",
    labels=labels,
    model_input=model_input,
    check_annotations=check_annotations,
    merge=merge,
    evaluate=evaluate,
    summarize=summarize,
    project_outputs=lambda config: {"gpkg": "detections.gpkg", "parquet": "detections.parquet"},
    merge_project=merge_project,
    quicklook=quicklook,
    counts=counts,
    count_unit="detections",
    implementation="rasterscale.tasks.detection.task:DetectionTask",
    config_keys={
        "model": (
            "score_threshold",
            "nms_threshold",
            "detections_per_tile",
            "resize",
            "backbone_weights",
            "fpn_channels",
        ),
        "merge": ("iou_threshold", "edge_tolerance", "containment_threshold"),
        "project": ("iou_threshold",),
        "evaluate": ("iou_threshold", "score_threshold"),
    },
)
