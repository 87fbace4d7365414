"""Instances' spec (torch-free): tree crowns as polygons (instance segmentation) into a polygon layer per scene
(GeoPackage and GeoParquet), merged across tiles by mask IoU and scored with precision, recall, F1 and mask AP at
mask IoU 0.5 (:func:`rasterscale.tasks.detectors.spec.objects_spec` says what it shares with detection)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rasterscale.raster.geometry_checks import count_rectangles
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.scene import Scene
from rasterscale.settings import Settings
from rasterscale.tasks.detectors.spec import ObjectLayer, objects_spec
from rasterscale.tasks.instances.groundtruth import check_ground_truth, read_ground_truth
from rasterscale.tasks.instances.merge import merge_scene
from rasterscale.tasks.instances.metrics import evaluate_scene
from rasterscale.tasks.instances.modelfiles import instances_of_config
from rasterscale.tasks.instances.project import merge_project
from rasterscale.tasks.instances.quicklook import render_instances_quicklook, scored_crowns

RECTANGLES_WARNED = 0.9  # the share of a file's polygons that are rectangles from which the dry run warns


def evaluate(
    scene: Scene, settings: Settings, labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    """The scene's crowns against its ground truth at ``evaluate.mask_iou_threshold``, with the scores of the crowns
    crossing an inner tile edge and of the others (the tile manifest's edges)."""
    raster = check_raster(scene.raster)
    column, image = scene.label_column or None, scene.image_path or None
    truth = read_ground_truth(scene.annotations, raster, list(labels), column, image)
    thresholds = {
        "iou_threshold": settings.evaluate.mask_iou_threshold,
        "score_threshold": settings.evaluate.score_threshold,
    }
    return evaluate_scene(
        scene.outputs["parquet"],
        scene.raster,
        truth.polygons,
        truth.labels,
        list(labels),
        thresholds,
        out,
        quicklook,
        scene.manifest,
    )


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


def scored(scene: Scene, min_score: float) -> np.ndarray:
    return scored_crowns(scene.outputs["parquet"], check_raster(scene.raster).transform, min_score)


INSTANCES = objects_spec(
    "instances",
    ObjectLayer(
        layer="crowns",
        shapes="crowns",
        ap_name="mask_ap50",
        of_config=instances_of_config,
        merge_scene=merge_scene,
        scored=scored,
        render_quicklook=render_instances_quicklook,
    ),
    model_keys=("mask_threshold",),
    evaluate_keys=("mask_iou_threshold", "score_threshold"),
    default_model_name="crowns",
    check_annotations=check_annotations,
    evaluate=evaluate,
    merge_project=merge_project,
    implementation="rasterscale.tasks.instances.task:InstancesTask",
    scene_keys=("rectangles_ok",),
    outlines=True,
)
