"""Tasks: what rasterscale predicts over a raster. The core (tiling, sharding, launching, rank files, pre-flight
checks) knows nothing of them; a task knows its model, its training samples, its rank output, its merge and its
evaluation (:class:`rasterscale.tasks.base.Task`, in the spirit of torchgeo's ``BaseTask``).

- ``detection``: boxes (torchvision RetinaNet, DeepForest's model) -> a vector layer per scene.
- ``segmentation``: a class per pixel (a segmentation-models-pytorch U-Net) -> a COG of classes per scene, its
  probabilities and its polygons.

This module is light (no torch): the workflow reads a task's file names and summaries from it at load time;
:func:`load_task` imports the task itself where a job needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rasterscale.tasks.base import Task

TASKS = ("detection", "segmentation")


def _detection_summary(metrics: Mapping[str, Any]) -> str:
    return (
        f"precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} f1={metrics['f1']:.3f} "
        f"map50={metrics['map50']:.3f}"
    )


def _segmentation_summary(metrics: Mapping[str, Any]) -> str:
    ious = " ".join(f"iou[{name}]={value:.3f}" for name, value in metrics["iou"].items() if value is not None)
    return f"miou={metrics['miou']:.3f} pixel_accuracy={metrics['pixel_accuracy']:.3f} {ious}"


@dataclass(frozen=True)
class TaskInfo:
    """A task's names: its scene outputs (under ``results/{scene}/``), its rank output's suffix, the file its
    evaluation reads, what its trained model is written as, and its evaluation's one-line summary."""

    name: str
    rank_suffix: str
    scene_outputs: Callable[[Mapping[str, Any]], dict[str, str]]  # config -> {key: file name}
    evaluated_output: str  # the key of scene_outputs that the evaluation reads
    model_files: dict[str, str]  # key -> file under results/models/ ("model", "metrics", "plot", ...)
    summarize: Callable[[Mapping[str, Any]], str]

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
        from rasterscale.tasks.detection import DetectionTask

        return DetectionTask()
    from rasterscale.tasks.segmentation import SegmentationTask

    return SegmentationTask()


def model_labels(config: Mapping[str, Any]) -> list[str]:
    """The effective class names of a validated config's task: ``model.labels`` over the model file's (header
    only: cheap enough for a dry run), else the task's default. A model file of the other task, or that
    contradicts the config, raises a one-line error naming it."""
    if config["task"] == "detection":
        from rasterscale.modelfiles import detector_of_config

        return list(detector_of_config(config)[0].labels)
    from rasterscale.segmentation.model import segmenter_of_config

    return list(segmenter_of_config(config).labels)


def check_annotations(
    task: str, path: str, raster: Any, labels: list[str], label_column: str | None, image_name: str
) -> None:
    """Header checks of a scene's ground truth for the task (one-line InputError naming the file)."""
    if task == "detection":
        from rasterscale.inputs import read_annotations

        read_annotations(path, raster, labels, label_column, image_name)
        return
    from rasterscale.segmentation.groundtruth import check_segmentation_truth

    check_segmentation_truth(path, raster, labels, label_column)
