"""Segmentation's spec (torch-free): a class per pixel into a COG of classes per scene (with its probabilities and
its polygons), scored with per-class IoU, mean IoU and pixel accuracy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rasterscale.atomic import write_json
from rasterscale.raster.bands import InputBands
from rasterscale.raster.headers import RasterInfo
from rasterscale.raster.imagery import read_spec
from rasterscale.raster.remote import file_name, shown
from rasterscale.scene import ProjectJobFields, Scene
from rasterscale.settings import Settings
from rasterscale.tasks.exported.card import CardRules, ModelCard
from rasterscale.tasks.exported.resolve import exported_card
from rasterscale.tasks.merging import write_project_mosaic
from rasterscale.tasks.segmentation.groundtruth import check_segmentation_truth, read_segmentation_truth
from rasterscale.tasks.segmentation.merge import count_classes, merge_class_rasters
from rasterscale.tasks.segmentation.metrics import evaluate_class_map, render_segmentation_quicklook
from rasterscale.tasks.segmentation.modelfiles import ARCHITECTURES, SegmenterConfig, segmenter_of_config
from rasterscale.tasks.segmentation.vectorize import vectorize_classes
from rasterscale.tasks.spec import MODEL_FILES, TaskSpec


def summarize(metrics: Mapping[str, Any]) -> str:
    ious = " ".join(f"iou[{name}]={value:.3f}" for name, value in metrics["iou"].items() if value is not None)
    return f"miou={metrics['miou']:.3f} pixel_accuracy={metrics['pixel_accuracy']:.3f} {ious}"


def merge(scene: Scene, outputs: Sequence[str], settings: Settings, labels: Sequence[str]) -> str:
    summary = merge_class_rasters(
        list(outputs),
        scene.raster,
        read_spec(scene.manifest),
        scene.outputs["classes"],
        scene.outputs.get("probabilities"),
        list(labels),
        gpkg_path=scene.outputs["gpkg"],
        threads=settings.cog.threads,
    )
    pixels = ", ".join(f"{label} {count}" for label, count in summary["pixels"].items())
    return (
        f"classes.tif ({pixels} px; nodata {summary['nodata_pixels']} px), {summary['polygons']} polygons -> "
        f"{scene.outputs['gpkg']}"
    )


def evaluate(
    scene: Scene, settings: Settings, labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    truth = read_segmentation_truth(scene.annotations, scene.raster, list(labels), scene.label_column)
    metrics = evaluate_class_map(scene.outputs["classes"], truth)
    metrics["scene_raster"] = shown(scene.raster)
    write_json(metrics, out)
    title = f"{file_name(scene.raster)}: mIoU={metrics['miou']:.3f}"
    render_segmentation_quicklook(scene.raster, scene.outputs["classes"], truth, quicklook, title=title)
    return metrics


def merge_project(job: ProjectJobFields) -> str:
    """The project's classes: a VRT over the scenes' class COGs, then the seams' (drawn over the scenes' where they
    predicted, their nodata left out), and its polygons."""
    outputs = job.outputs
    rasters = write_project_mosaic(job, "classes", "segmentation")
    polygons = vectorize_classes(outputs["classes"], outputs["gpkg"], list(job.labels))
    return f"{outputs['classes']} over {rasters} class rasters, {polygons} polygons -> {outputs['gpkg']}"


def quicklook(scene: Scene, settings: Settings, png: str | Path, title: str) -> None:
    render_segmentation_quicklook(scene.raster, scene.outputs["classes"], None, png, title=title)


def counts(scene: Scene, labels: Sequence[str]) -> dict[str, int]:
    return count_classes(scene.outputs["classes"], list(labels))


# an exported segmentation model gives a channel per class: logits, or probabilities
CARD = CardRules("segmentation", ("logits", "probabilities"), min_labels=2)


def segmentation_model(settings: Settings, check: bool = True) -> SegmenterConfig | ModelCard:
    """The config's segmentation model: an exported file's card (checked against the file when ``check``), else
    the segmenter that the keys and the model file make."""
    return exported_card(settings, CARD, check) or segmenter_of_config(settings)


def labels(settings: Settings) -> list[str]:
    return list(segmentation_model(settings).labels)


def model_input(settings: Settings) -> InputBands:
    return segmentation_model(settings).input


def check_annotations(path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str) -> None:
    check_segmentation_truth(path, raster, labels, label_column)


SEGMENTATION = TaskSpec(
    name="segmentation",
    rank_suffix=".tif",
    scene_outputs=lambda settings: {
        "classes": "classes.tif",
        "gpkg": "classes.gpkg",
        **({"probabilities": "probabilities.tif"} if settings.predict.probabilities else {}),
    },
    evaluated_output="classes",
    model_files=MODEL_FILES,
    default_model_name="segmenter",
    labels=labels,
    check_annotations=check_annotations,
    merge=merge,
    evaluate=evaluate,
    summarize=summarize,
    project_outputs=lambda settings: {"classes": "classes.vrt", "gpkg": "classes.gpkg"},
    merge_project=merge_project,
    quicklook=quicklook,
    counts=counts,
    count_unit="pixels",
    implementation="rasterscale.tasks.segmentation.task:SegmentationTask",
    model_input=model_input,
    config_keys={"model": ("architecture", "encoder", "encoder_weights", "card"), "predict": ("probabilities",)},
    schema_enums={"model.architecture": ARCHITECTURES},
    exported_outputs=CARD.outputs,
    cog_layers=True,
    project_summary="classes",
)
