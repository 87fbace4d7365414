"""A task's torch-free half (:class:`TaskSpec`): what the workflow and the schema read from a task at plan time,
and what the merge and evaluation jobs run, without importing torch. The torch half (model, training samples,
rank outputs) is :class:`rasterscale.tasks.api.Task`, which :meth:`TaskSpec.load` imports."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rasterscale.raster.bands import InputBands
from rasterscale.raster.headers import RasterInfo
from rasterscale.scene import ProjectJobFields, Scene
from rasterscale.settings import SceneSettings, Settings

if TYPE_CHECKING:
    from rasterscale.tasks.api import Task


# every task's (a model that DeepForest reads too adds its model folder: rasterscale.tasks.detectors.spec)
MODEL_FILES = {"model": "{name}.pt", "metrics": "{name}.metrics.csv", "plot": "{name}.png"}


@dataclass(frozen=True)
class TaskSpec:
    """What a task is, as the workflow sees it.

    - ``scene_outputs(settings)``: a scene's merged outputs, ``{key: file name}`` under ``results/{run}/{scene}/``;
      ``evaluated_output`` is the key the evaluation reads; ``rank_suffix`` the suffix of a rank's output;
    - ``model_files``: what training writes, ``{key: file under results/models/}`` with ``{name}`` for the model's;
    - ``default_model_name``: ``model.name`` when the config leaves it null;
    - ``config_keys``: keys (by section) that only this task reads: set under another task, they are an error;
      ``scene_keys``: keys of a scene (``scenes.X.*``) that only this task reads, the same;
      ``check_scene_keys(scene, key_of)``: the dry run's checks of the files those keys name (a local file that is
      missing or holds the wrong geometries: one line naming it; ``key_of(key)`` names the key in the message);
    - ``schema_enums``: the allowed values of this task's keys (``"section.key"``), which the schema takes from here;
    - ``labels(settings)``: the effective class names (``model.labels`` over the model file's header, else the
      task's default), cheap enough for a dry run; ``model_input(settings)``: the bands the model takes (its file's
      when predicting with one, else the training scenes' and ``model.band_names``/``normalize``:
      :func:`rasterscale.tasks.modelinput.model_input`);
    - ``check_annotations(path, raster, labels, label_column, image_name)``: header checks of a scene's ground
      truth, one-line :class:`~rasterscale.errors.InputError` naming the file; its warnings (a file that is likely
      a mistake), each ``(scene key, line)``: the dry run says the line (``{scene}`` the scene's name) unless the
      scene sets that key true;
    - ``merge(scene, outputs, settings, labels)``: a scene's rank outputs into its layers (``scene``: a
      :class:`~rasterscale.scene.Scene`, its layers' files in ``scene.outputs``; ``labels``: the resolved class
      names); a line for the log;
    - ``evaluate(scene, settings, labels, out, quicklook)``: the merged output scored against the annotations,
      written to ``out`` (JSON) with a quicklook; the metrics; ``summarize(metrics)`` their one-line summary;
    - ``project_outputs(settings)``: the project's layers, ``{key: file name}`` under ``results/{run}/project/``;
      ``merge_project(job)`` merges them (``job``: a :class:`rasterscale.jobs.files.ProjectJob`, read as its
      :class:`~rasterscale.scene.ProjectJobFields`), a line for the log;
    - ``quicklook(scene, settings, png, title)``: the same picture of a scene's merged output over its imagery, for a
      scene without annotations (no ground truth drawn);
    - ``counts(scene, labels)``: what a scene's merged output holds, by class name, in ``count_unit`` (the report's
      tables and project map);
    - ``implementation``: ``"module:Class"`` of the torch half;
    - ``exported_outputs``: the output layouts an exported model file of this task may give (its model card's
      ``output``; the first is what the task's own models give), empty when the task takes no exported files;
    - ``outlines``: its objects are outlines (polygons), not boxes (a merge's memory estimate);
    - ``cog_layers``: its merge writes COG layers, compressed on the merge job's cores (``cog.threads``);
    - ``project_summary``: what the project's summary raster (:mod:`rasterscale.raster.summary`) holds: ``objects``
      per hectare (the project layer ``parquet``; a large project's is partitioned, ``merge_project`` writing one
      partition when its job names ``owners``), the ``classes``' cover or the ``values``' mean (the project layer
      of that key).
    """

    name: str
    rank_suffix: str
    scene_outputs: Callable[[Settings], dict[str, str]]
    evaluated_output: str
    model_files: dict[str, str]
    default_model_name: str
    labels: Callable[[Settings], list[str]]
    check_annotations: Callable[[str, RasterInfo, list[str], str | None, str], Sequence[tuple[str, str]] | None]
    merge: Callable[[Scene, Sequence[str], Settings, Sequence[str]], str]
    evaluate: Callable[..., dict[str, Any]]
    summarize: Callable[[Mapping[str, Any]], str]
    project_outputs: Callable[[Settings], dict[str, str]]
    merge_project: Callable[[ProjectJobFields], str]
    quicklook: Callable[[Scene, Settings, str | Path, str], None]
    counts: Callable[[Scene, Sequence[str]], dict[str, int]]
    count_unit: str
    implementation: str
    model_input: Callable[[Settings], InputBands]
    config_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    scene_keys: tuple[str, ...] = ()
    check_scene_keys: Callable[[SceneSettings, Callable[[str], str]], None] = lambda scene, key_of: None
    schema_enums: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    exported_outputs: tuple[str, ...] = ()
    outlines: bool = False
    cog_layers: bool = False
    project_summary: str = "objects"

    def load(self) -> Task:
        """The task's torch half. The one import of a task's torch side, done here (lazily) so that the workflow,
        merge and evaluation jobs, which read only this spec, never import torch."""
        module, _, cls = self.implementation.partition(":")
        return getattr(importlib.import_module(module), cls)()


@dataclass(frozen=True)
class Part:
    """A part of a rank output: its file, the own tile_ids it vouches for, and what its task says of it."""

    path: Path
    tiles: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
