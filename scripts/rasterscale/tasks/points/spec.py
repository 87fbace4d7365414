"""The points task's spec (torch-free): objects as points (tree tops, birds, animals) into a vector layer per scene
and for the project (``points.gpkg`` and ``points.parquet``), each point once across tiles (the tiles' cores),
scenes and seams (the project's ownership), scored by one-to-one matching within ``evaluate.point_distance``
(precision, recall, F1 per class and by score) and by the count's error per summary cell.

A scene's ground truth (``scenes.X.annotations``) is points in any form users hold (:mod:`.groundtruth`): a vector
file of points in any CRS, DeepForest's point CSV or COCO keypoints; boxes and polygons are taken as their
centroids, with one dry-run warning (``scenes.X.centroids_ok`` silences it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rasterscale.raster.bands import InputBands
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.scene import Scene
from rasterscale.settings import Settings
from rasterscale.tasks.detectors.merge import count_labels
from rasterscale.tasks.encoders import ARCHITECTURES
from rasterscale.tasks.exported.card import CardRules, ModelCard
from rasterscale.tasks.exported.resolve import exported_card
from rasterscale.tasks.points.groundtruth import check_annotations, read_points
from rasterscale.tasks.points.merge import merge_scene
from rasterscale.tasks.points.metrics import evaluate_points, summarize
from rasterscale.tasks.points.modelfiles import LOSSES, PointsConfig, points_of_config
from rasterscale.tasks.points.project import merge_project
from rasterscale.tasks.points.quicklook import render_points_quicklook, scored_points
from rasterscale.tasks.spec import MODEL_FILES, TaskSpec

LAYERS = {"gpkg": "points.gpkg", "parquet": "points.parquet"}


def layers(settings: Settings) -> dict[str, str]:
    return dict(LAYERS)


# an exported point model gives a heatmap channel per class: its logits, or the heatmap itself (in [0, 1])
CARD = CardRules("points", ("logits", "heatmap"))


def points_model(settings: Settings, check: bool = True) -> PointsConfig | ModelCard:
    """The config's point model: an exported file's card (checked against the file when ``check``), else the
    point model that the keys and the model file make."""
    return exported_card(settings, CARD, check) or points_of_config(settings)


def labels(settings: Settings) -> list[str]:
    return list(points_model(settings).labels)


def model_input(settings: Settings) -> InputBands:
    return points_model(settings).input


def merge(scene: Scene, outputs: Sequence[str], settings: Settings, labels: Sequence[str]) -> str:
    merged = merge_scene(
        outputs,
        scene.manifest,
        scene.raster,
        scene.outputs["gpkg"],
        scene.outputs["parquet"],
        settings.merge.point_distance,
    )
    return f"{len(merged)} points -> {scene.outputs['gpkg']}"


def evaluate(
    scene: Scene, settings: Settings, labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    raster = check_raster(scene.raster)
    truth = read_points(scene.annotations, raster, list(labels), scene.label_column or None, scene.image_path)
    return evaluate_points(
        scene.outputs["parquet"],
        scene.raster,
        truth,
        list(labels),
        settings.evaluate.point_distance,
        settings.evaluate.score_threshold,
        settings.evaluate.count_cell,
        out,
        quicklook,
        scene.image_path,
    )


def check_truth(path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str) -> Any:
    return check_annotations(path, raster, labels, label_column, image)


def quicklook(scene: Scene, settings: Settings, png: str | Path, title: str) -> None:
    """The evaluation's picture without ground truth: the points scoring at least evaluate.score_threshold."""
    threshold = settings.evaluate.score_threshold
    found = scored_points(scene.outputs["parquet"], threshold)
    render_points_quicklook(
        scene.raster, found, None, png, title=f"{title}: {len(found)} points of score >= {threshold}"
    )


def counts(scene: Scene, labels: Sequence[str]) -> dict[str, int]:
    return count_labels(scene.outputs["parquet"], labels)


POINTS = TaskSpec(
    name="points",
    rank_suffix=".parquet",
    scene_outputs=layers,
    evaluated_output="parquet",
    model_files=MODEL_FILES,
    default_model_name="points",
    labels=labels,
    check_annotations=check_truth,
    merge=merge,
    evaluate=evaluate,
    summarize=summarize,
    project_outputs=layers,
    merge_project=merge_project,
    quicklook=quicklook,
    counts=counts,
    count_unit="points",
    implementation="rasterscale.tasks.points.task:PointsTask",
    model_input=model_input,
    config_keys={
        "model": (
            "architecture",
            "encoder",
            "encoder_weights",
            "loss",
            "sigma",
            "score_threshold",
            "detections_per_tile",
            "card",
        ),
        "merge": ("point_distance",),
        "project": ("partition_scenes",),
        "evaluate": ("point_distance", "count_cell"),
    },
    scene_keys=("centroids_ok",),
    schema_enums={"model.loss": LOSSES, "model.architecture": ARCHITECTURES},
    exported_outputs=CARD.outputs,
)
