"""Tasks: what rasterscale predicts over a raster. The core (tiling, sharding, launching, rank files, pre-flight
checks) knows nothing of them; a task knows its model, its training samples and its rank output
(:class:`rasterscale.tasks.api.Task`, in the spirit of torchgeo's ``BaseTask``), and its merge and its evaluation
(:class:`TaskInfo`, here).

- ``detection``: boxes (torchvision RetinaNet, DeepForest's model) -> a vector layer per scene.
- ``segmentation``: a class per pixel (a segmentation-models-pytorch U-Net) -> a COG of classes per scene, its
  probabilities and its polygons.

This module is light (no torch): the workflow reads a task's file names and summaries from it at load time, and
the merge and evaluation jobs run a task's merge and scoring from it (:class:`TaskInfo`); :func:`load_task`
imports the task itself (model, training, prediction) where a job needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rasterscale.tasks.api import Task

TASKS = ("detection", "segmentation")


def _detection_summary(metrics: Mapping[str, Any]) -> str:
    return (
        f"precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} f1={metrics['f1']:.3f} "
        f"map50={metrics['map50']:.3f}"
    )


def _segmentation_summary(metrics: Mapping[str, Any]) -> str:
    ious = " ".join(f"iou[{name}]={value:.3f}" for name, value in metrics["iou"].items() if value is not None)
    return f"miou={metrics['miou']:.3f} pixel_accuracy={metrics['pixel_accuracy']:.3f} {ious}"


def _merge_detections(scene: Mapping[str, Any], outputs: Sequence[str], config: Mapping[str, Any]) -> str:
    from rasterscale.tasks.detection.merge import merge_scene

    merged = merge_scene(outputs, scene["manifest"], scene["raster"], scene["gpkg"], scene["parquet"], config["merge"])
    return f"{len(merged)} detections -> {scene['gpkg']}"


def _evaluate_detections(
    scene: Mapping[str, Any], config: Mapping[str, Any], labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    from rasterscale.tasks.detection.evaluate import evaluate_scene

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


def _merge_segmentation(scene: Mapping[str, Any], outputs: Sequence[str], config: Mapping[str, Any]) -> str:
    from rasterscale.raster.imagery import read_spec
    from rasterscale.tasks.segmentation.merge import merge_class_rasters, vectorize_classes

    labels = config["labels"]
    summary = merge_class_rasters(
        list(outputs),
        scene["raster"],
        read_spec(scene["manifest"]),
        scene["classes"],
        scene.get("probabilities"),
        labels,
    )
    polygons = vectorize_classes(scene["classes"], scene["gpkg"], labels)
    pixels = ", ".join(f"{label} {count}" for label, count in summary["pixels"].items())
    return f"classes.tif ({pixels} px; nodata {summary['nodata_pixels']} px), {polygons} polygons -> {scene['gpkg']}"


def _evaluate_segmentation(
    scene: Mapping[str, Any], config: Mapping[str, Any], labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    from rasterscale.atomic import write_json
    from rasterscale.tasks.segmentation.groundtruth import read_segmentation_truth
    from rasterscale.tasks.segmentation.metrics import evaluate_class_map, render_segmentation_quicklook

    truth = read_segmentation_truth(scene["annotations"], scene["raster"], list(labels), scene.get("label_column"))
    metrics = evaluate_class_map(scene["classes"], truth)
    metrics["scene_raster"] = str(scene["raster"])
    write_json(metrics, out)
    title = f"{Path(scene['raster']).name}: mIoU={metrics['miou']:.3f}"
    render_segmentation_quicklook(scene["raster"], scene["classes"], truth, quicklook, title=title)
    return metrics


@dataclass(frozen=True)
class TaskInfo:
    """A task's names: its scene outputs (under ``results/{scene}/``), its rank output's suffix, the file its
    evaluation reads, what its trained model is written as, and its evaluation's one-line summary; and how its
    layers are made and scored (torch-free, so that merge and evaluation jobs do not load it):

    - ``merge(scene, outputs, config)``: a scene's rank outputs (their records already checked) into its layers
      (``scene``: its entry in the batch's job file: raster, manifest, output paths); a line for the log;
    - ``evaluate(scene, config, labels, out, quicklook)``: the scene's merged output scored against its
      annotations, written to ``out`` (JSON) with a quicklook; the metrics.
    """

    name: str
    rank_suffix: str
    scene_outputs: Callable[[Mapping[str, Any]], dict[str, str]]  # config -> {key: file name}
    evaluated_output: str  # the key of scene_outputs that the evaluation reads
    model_files: dict[str, str]  # key -> file under results/models/ ("model", "metrics", "plot", ...)
    summarize: Callable[[Mapping[str, Any]], str]
    merge: Callable[[Mapping[str, Any], Sequence[str], Mapping[str, Any]], str]
    evaluate: Callable[..., dict[str, Any]]

    def outputs_of_scene(self, config: Mapping[str, Any], scene: str) -> dict[str, str]:
        """A scene's merged outputs, with the gathered prediction profile."""
        files = {**self.scene_outputs(config), "profile": "predict_profile.json"}
        return {key: f"results/{scene}/{name}" for key, name in files.items()}

    def trained_model_files(self, name: str) -> dict[str, str]:
        """What training writes for the model ``name``, by key (model, metrics, plot, and the task's others)."""
        return {key: f"results/models/{file.format(name=name)}" for key, file in self.model_files.items()}


DETECTION = TaskInfo(
    name="detection",
    rank_suffix=".parquet",
    scene_outputs=lambda config: {"gpkg": "detections.gpkg", "parquet": "detections.parquet"},
    evaluated_output="parquet",
    model_files={
        "model": "{name}.pt",
        "deepforest_config": "{name}/config.json",
        "deepforest_weights": "{name}/model.safetensors",
        "metrics": "{name}.metrics.csv",
        "plot": "{name}.png",
    },
    summarize=_detection_summary,
    merge=_merge_detections,
    evaluate=_evaluate_detections,
)

SEGMENTATION = TaskInfo(
    name="segmentation",
    rank_suffix=".tif",
    scene_outputs=lambda config: {
        "classes": "classes.tif",
        "gpkg": "classes.gpkg",
        **({"probabilities": "probabilities.tif"} if config["predict"]["probabilities"] else {}),
    },
    evaluated_output="classes",
    model_files={"model": "{name}.pt", "metrics": "{name}.metrics.csv", "plot": "{name}.png"},
    summarize=_segmentation_summary,
    merge=_merge_segmentation,
    evaluate=_evaluate_segmentation,
)

INFO = {"detection": DETECTION, "segmentation": SEGMENTATION}


def task_info(name: str) -> TaskInfo:
    if name not in INFO:
        raise ValueError(f"unknown task {name!r} (one of {', '.join(TASKS)})")
    return INFO[name]


def load_task(name: str) -> Task:
    """The task's implementation (imports torch and the task's libraries)."""
    task_info(name)
    if name == "detection":
        from rasterscale.tasks.detection.task import DetectionTask

        return DetectionTask()
    from rasterscale.tasks.segmentation.task import SegmentationTask

    return SegmentationTask()


def model_labels(config: Mapping[str, Any]) -> list[str]:
    """The effective class names of a validated config's task: ``model.labels`` over the model file's (header
    only: cheap enough for a dry run), else the task's default. A model file of the other task, or that
    contradicts the config, raises a one-line error naming it."""
    if config["task"] == "detection":
        from rasterscale.tasks.detection.modelfiles import detector_of_config

        return list(detector_of_config(config)[0].labels)
    from rasterscale.tasks.segmentation.modelfiles import segmenter_of_config

    return list(segmenter_of_config(config).labels)


def check_annotations(
    task: str, path: str, raster: Any, labels: list[str], label_column: str | None, image_name: str
) -> None:
    """Header checks of a scene's ground truth for the task (one-line InputError naming the file)."""
    if task == "detection":
        from rasterscale.tasks.detection.annotations import read_annotations

        read_annotations(path, raster, labels, label_column, image_name)
        return
    from rasterscale.tasks.segmentation.groundtruth import check_segmentation_truth

    check_segmentation_truth(path, raster, labels, label_column)
