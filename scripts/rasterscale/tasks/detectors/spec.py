"""The torch-free spec (:class:`~rasterscale.tasks.spec.TaskSpec`) of a task that finds objects (detection's boxes,
instances' crowns): a vector layer per scene and for the project (GeoPackage and GeoParquet, one file name for
both), rank files of GeoParquet merged across tile overlaps, a model file with its DeepForest model folder beside it,
precision, recall, F1 and an AP as scores, the quicklook of a scene without ground truth, the layer's counts by label,
and the config keys every such task reads (:func:`objects_spec`). Each task adds its model files, ground truth,
merge, scores, shapes and project layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasterscale.raster.bands import InputBands
from rasterscale.scene import Scene
from rasterscale.settings import Settings
from rasterscale.tasks.detectors.merge import count_labels
from rasterscale.tasks.detectors.modelfiles import ResNetFPNConfig
from rasterscale.tasks.spec import MODEL_FILES, TaskSpec

# a model that DeepForest reads too: every task's model files and its DeepForest model folder
MODEL_FILES_WITH_DEEPFOREST = {
    **MODEL_FILES,
    "deepforest_config": "{name}/config.json",
    "deepforest_weights": "{name}/model.safetensors",
}
# the keys of a torchvision detector's model, its cross-tile merge and its project layer
MODEL_KEYS = ("score_threshold", "nms_threshold", "detections_per_tile", "resize", "backbone_weights", "fpn_channels")
MERGE_KEYS = ("iou_threshold", "edge_tolerance", "containment_threshold")
PROJECT_KEYS = ("iou_threshold", "partition_scenes")

# a task's merge of a scene: (rank files, tile manifest, raster, GeoPackage, GeoParquet, the merge settings) -> the
# scene's merged objects
SceneMerge = Callable[..., Sized]
# a scene's shapes (by its paths: the scene as a mapping) scoring at least a score, in the raster's pixels
ScoredShapes = Callable[[Scene, float], Sized]
# a task's quicklook: (raster, predicted shapes, true shapes or None, png, title=...)
Quicklook = Callable[..., None]


@dataclass(frozen=True)
class ObjectLayer:
    """What a task that finds objects does with its layer: its scene's and project's layers are ``{layer}.gpkg``
    and ``{layer}.parquet`` and it counts ``layer`` (``"crowns"``), drawn as ``shapes`` (``"boxes"``); ``ap_name``
    is what its summary calls its AP; ``of_config`` its effective model configuration (labels, input bands) and
    the header of the file it names; ``merge_scene`` merges a scene's rank files; ``scored`` and
    ``render_quicklook`` draw a scene without ground truth."""

    layer: str
    shapes: str
    ap_name: str
    of_config: Callable[[Settings], tuple[ResNetFPNConfig, Any]]
    merge_scene: SceneMerge
    scored: ScoredShapes
    render_quicklook: Quicklook

    def layers(self, settings: Settings) -> dict[str, str]:
        return {"gpkg": f"{self.layer}.gpkg", "parquet": f"{self.layer}.parquet"}

    def labels(self, settings: Settings) -> list[str]:
        return list(self.of_config(settings)[0].labels)

    def model_input(self, settings: Settings) -> InputBands:
        return self.of_config(settings)[0].input

    def merge(self, scene: Scene, outputs: Sequence[str], settings: Settings, labels: Sequence[str]) -> str:
        merged = self.merge_scene(
            outputs, scene.manifest, scene.raster, scene.outputs["gpkg"], scene.outputs["parquet"], settings.merge
        )
        return f"{len(merged)} {self.layer} -> {scene.outputs['gpkg']}"

    def summarize(self, metrics: Mapping[str, Any]) -> str:
        return (
            f"precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} f1={metrics['f1']:.3f} "
            f"{self.ap_name}={metrics['map50']:.3f}"
        )

    def quicklook(self, scene: Scene, settings: Settings, png: str | Path, title: str) -> None:
        """The evaluation's picture without ground truth: the shapes scoring at least evaluate.score_threshold."""
        threshold = settings.evaluate.score_threshold
        found = self.scored(scene, threshold)
        text = f"{title}: {len(found)} {self.shapes} of score >= {threshold}"
        self.render_quicklook(scene.raster, found, None, png, title=text)

    def counts(self, scene: Scene, labels: Sequence[str]) -> dict[str, int]:
        return count_labels(scene.outputs["parquet"], labels)


def objects_spec(
    name: str, objects: ObjectLayer, *, model_keys: tuple[str, ...], evaluate_keys: tuple[str, ...], **fields: Any
) -> TaskSpec:
    """The spec of the task ``name`` that finds ``objects``: the keys only it reads are :data:`MODEL_KEYS` and
    ``model_keys``, :data:`MERGE_KEYS`, :data:`PROJECT_KEYS` and ``evaluate_keys``. ``fields``: the rest of the
    :class:`~rasterscale.tasks.spec.TaskSpec`'s (check_annotations, evaluate, merge_project, implementation,
    default_model_name, ...)."""
    return TaskSpec(
        name=name,
        rank_suffix=".parquet",
        scene_outputs=objects.layers,
        evaluated_output="parquet",
        model_files=MODEL_FILES_WITH_DEEPFOREST,
        labels=objects.labels,
        model_input=objects.model_input,
        merge=objects.merge,
        summarize=objects.summarize,
        project_outputs=objects.layers,
        quicklook=objects.quicklook,
        counts=objects.counts,
        count_unit=objects.layer,
        config_keys={
            "model": (*MODEL_KEYS, *model_keys),
            "merge": MERGE_KEYS,
            "project": PROJECT_KEYS,
            "evaluate": evaluate_keys,
        },
        **fields,
    )
