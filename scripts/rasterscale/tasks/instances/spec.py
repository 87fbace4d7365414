"""Instances' spec (torch-free): tree crowns as polygons (instance segmentation) into a polygon layer per scene
(GeoPackage and GeoParquet), merged across tiles by mask IoU and scored with precision, recall, F1 and mask AP at
mask IoU 0.5."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rasterscale.raster.bands import InputBands
from rasterscale.raster.geometry_checks import count_rectangles
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.tasks.instances.evaluate import evaluate_scene
from rasterscale.tasks.instances.groundtruth import check_ground_truth, read_ground_truth
from rasterscale.tasks.instances.merge import count_instances, merge_scene
from rasterscale.tasks.instances.modelfiles import instances_of_config
from rasterscale.tasks.instances.project import merge_project
from rasterscale.tasks.instances.quicklook import render_instances_quicklook, scored_crowns
from rasterscale.tasks.spec import MODEL_FILES_WITH_DEEPFOREST, TaskSpec

RECTANGLES_WARNED = 0.9  # the share of a file's polygons that are rectangles from which the dry run warns


def summarize(metrics: Mapping[str, Any]) -> str:
    return (
        f"precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} f1={metrics['f1']:.3f} "
        f"mask_ap50={metrics['map50']:.3f}"
    )


def merge(scene: Mapping[str, Any], outputs: Sequence[str], config: Mapping[str, Any]) -> str:
    merged = merge_scene(outputs, scene["manifest"], scene["raster"], scene["gpkg"], scene["parquet"], config["merge"])
    return f"{len(merged)} crowns -> {scene['gpkg']}"


def evaluate(
    scene: Mapping[str, Any], config: Mapping[str, Any], labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    """The scene's crowns against its ground truth at ``evaluate.mask_iou_threshold``, with the scores of the crowns
    crossing an inner tile edge and of the others (the tile manifest's edges)."""
    raster = check_raster(scene["raster"])
    column, image = scene.get("label_column") or None, scene.get("image_path") or None
    truth = read_ground_truth(scene["annotations"], raster, list(labels), column, image)
    thresholds = {
        "iou_threshold": config["evaluate"]["mask_iou_threshold"],
        "score_threshold": config["evaluate"]["score_threshold"],
    }
    return evaluate_scene(
        scene["parquet"],
        scene["raster"],
        truth.polygons,
        truth.labels,
        list(labels),
        thresholds,
        out,
        quicklook,
        scene["manifest"],
    )


def quicklook(scene: Mapping[str, Any], config: Mapping[str, Any], png: str | Path, title: str) -> None:
    """The evaluation's picture without ground truth: the crowns scoring at least evaluate.score_threshold."""
    threshold = config["evaluate"]["score_threshold"]
    crowns = scored_crowns(scene["parquet"], check_raster(scene["raster"]).transform, threshold)
    text = f"{title}: {len(crowns)} crowns of score >= {threshold}"
    render_instances_quicklook(scene["raster"], crowns, None, png, title=text)


def counts(scene: Mapping[str, Any], labels: Sequence[str]) -> dict[str, int]:
    return count_instances(scene["parquet"], labels)


def labels(config: Mapping[str, Any]) -> list[str]:
    return list(instances_of_config(config)[0].labels)


def model_input(config: Mapping[str, Any]) -> InputBands:
    return instances_of_config(config)[0].input


def check_annotations(
    path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str
) -> list[tuple[str, str]]:
    """The ground truth's checks; a warning when its polygons are (nearly) all axis-aligned rectangles: a box file
    given by mistake, on which Mask R-CNN learns rectangular crowns (``scenes.X.rectangles_ok`` silences it)."""
    truth = check_ground_truth(path, raster, labels, label_column, image)
    rectangles, total = count_rectangles(truth.polygons), len(truth.polygons)
    if total and rectangles >= RECTANGLES_WARNED * total:
        line = (
            f"{path}: {rectangles} of {total} polygons are axis-aligned rectangles: boxes, not crowns' outlines? "
            "Mask R-CNN would learn rectangular crowns; give outlines (a COCO JSON file or polygons), or set "
            "scenes.{scene}.rectangles_ok: true if they are meant"
        )
        return [("rectangles_ok", line)]
    return []


INSTANCES = TaskSpec(
    name="instances",
    rank_suffix=".parquet",
    scene_outputs=lambda config: {"gpkg": "crowns.gpkg", "parquet": "crowns.parquet"},
    evaluated_output="parquet",
    model_files=MODEL_FILES_WITH_DEEPFOREST,
    default_model_name="crowns",
    labels=labels,
    model_input=model_input,
    check_annotations=check_annotations,
    merge=merge,
    evaluate=evaluate,
    summarize=summarize,
    project_outputs=lambda config: {"gpkg": "crowns.gpkg", "parquet": "crowns.parquet"},
    merge_project=merge_project,
    quicklook=quicklook,
    counts=counts,
    count_unit="crowns",
    implementation="rasterscale.tasks.instances.task:InstancesTask",
    scene_keys=("rectangles_ok",),
    config_keys={
        "model": (
            "score_threshold",
            "nms_threshold",
            "detections_per_tile",
            "mask_threshold",
            "resize",
            "backbone_weights",
            "fpn_channels",
        ),
        "merge": ("iou_threshold", "edge_tolerance", "containment_threshold"),
        "project": ("iou_threshold",),
        "evaluate": ("mask_iou_threshold", "score_threshold"),
    },
)
