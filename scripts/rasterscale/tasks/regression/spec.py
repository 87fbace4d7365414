"""Regression's spec (torch-free): one value (or K values, ``model.labels``) per pixel, e.g. canopy height, into a
float32 COG per scene (``values.tif``), scored with MAE, RMSE, bias and R², overall and by range of the true value.

A scene's ground truth (``scenes.X.annotations``) is a float raster of the values (:mod:`.targets`); rank outputs
are blended value rasters (:mod:`.blend`), merged into ``values.tif`` (:mod:`.merge`, nodata
:data:`~rasterscale.tasks.regression.merge.NODATA_VALUE`); the project's layer is a VRT over the scenes' (and seams')
``values.tif``. With ``merge.tree_tops`` the merge also finds the tree tops of the height (the first value) in the
scene's ``values.tif`` and the project's mosaic (:mod:`.treetops`), each top once, and the evaluation scores them
against a scene's true tops (``scenes.X.tree_tops``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rasterscale.atomic import write_json
from rasterscale.errors import InputError
from rasterscale.raster.bands import InputBands
from rasterscale.raster.headers import RasterInfo
from rasterscale.raster.imagery import read_spec
from rasterscale.raster.remote import file_name, is_remote, shown
from rasterscale.scene import ProjectJobFields, Scene
from rasterscale.settings import SceneSettings, Settings
from rasterscale.tasks.encoders import ARCHITECTURES
from rasterscale.tasks.exported.card import CardRules, ModelCard
from rasterscale.tasks.exported.resolve import exported_card
from rasterscale.tasks.merging import write_project_mosaic
from rasterscale.tasks.regression.groundtruth import check_targets, read_targets
from rasterscale.tasks.regression.merge import count_values, merge_value_rasters
from rasterscale.tasks.regression.metrics import evaluate_values, render_density_plot, render_values_quicklook
from rasterscale.tasks.regression.modelfiles import LOSSES, RegressorConfig, regressor_of_config
from rasterscale.tasks.regression.treetops import (
    TreeTopRule,
    find_tree_tops,
    read_tree_tops,
    score_tree_tops,
    write_tree_tops,
)
from rasterscale.tasks.spec import MODEL_FILES, TaskSpec

VALUES = "values.tif"  # a scene's merged values (every label a band of it)
TREE_TOPS = {"tops": "tree_tops.parquet", "tops_gpkg": "tree_tops.gpkg"}  # with merge.tree_tops


def tree_top_rule(tree_tops: Mapping[str, Any] | None) -> TreeTopRule | None:
    """The tree-top rule of ``merge.tree_tops`` (None: no tree tops)."""
    return TreeTopRule(**tree_tops) if tree_tops else None


def tree_top_outputs(settings: Settings) -> dict[str, str]:
    return dict(TREE_TOPS) if settings.merge.tree_tops else {}


def write_tops(values: str | Path, rule: TreeTopRule, outputs: Mapping[str, str]) -> str:
    """The tree tops of a height raster (its first band) written to ``outputs``; a line for the log."""
    tops = find_tree_tops(values, rule)
    write_tree_tops(tops, outputs["tops_gpkg"], outputs["tops"])
    return f"{len(tops)} tree tops -> {outputs['tops']}"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def summarize(metrics: Mapping[str, Any]) -> str:
    first = metrics["labels"][0]
    scores = " ".join(f"{key}={_number(metrics[key])}" for key in ("mae", "rmse", "bias", "r2"))
    line = f"{first}: {scores} ({metrics['pixels']} px)"
    tops = metrics.get("tree_tops")
    if tops:
        line += (
            f"; tree tops precision={tops['precision']:.3f} recall={tops['recall']:.3f} f1={tops['f1']:.3f} "
            f"({tops['matched']} of {tops['true']} matched)"
        )
    return line


def merge(scene: Scene, outputs: Sequence[str], settings: Settings, labels: Sequence[str]) -> str:
    summary = merge_value_rasters(
        list(outputs),
        scene.raster,
        read_spec(scene.manifest),
        scene.outputs["values"],
        list(labels),
        threads=settings.cog.threads,
    )
    means = ", ".join(f"mean {label} {_number(mean)}" for label, mean in summary["mean"].items())
    line = f"{VALUES} ({summary['pixels']} px with values, {means}; nodata {summary['nodata_pixels']} px)"
    rule = tree_top_rule(settings.merge.tree_tops)
    return line if rule is None else f"{line}; {write_tops(scene.outputs['values'], rule, scene.outputs)}"


def evaluate(
    scene: Scene, settings: Settings, labels: Sequence[str], out: str | Path, quicklook: str | Path
) -> dict[str, Any]:
    targets = read_targets(scene.annotations, scene.raster, list(labels))
    metrics, histograms = evaluate_values(scene.outputs["values"], targets, list(labels))
    metrics["scene_raster"] = shown(scene.raster)
    if scene.tree_tops and scene.outputs.get("tops"):  # true tops, and the tops merge.tree_tops found
        truth = read_tree_tops(scene.tree_tops)
        metrics["tree_tops"] = score_tree_tops(
            read_tree_tops(scene.outputs["tops"]), truth, settings.evaluate.tree_top_distance
        )
    write_json(metrics, out)
    title = f"{file_name(scene.raster)}: {summarize(metrics)}"
    render_density_plot(histograms, list(labels), quicklook, title=title)
    return metrics


def merge_project(job: ProjectJobFields) -> str:
    """The project's values: a VRT over the scenes' values COGs, then the seams' (drawn over the scenes' where they
    predicted, their nodata left out)."""
    outputs = job.outputs
    rasters = write_project_mosaic(job, "values", "regression")
    line = f"{outputs['values']} over {rasters} value rasters"
    rule = tree_top_rule(job.settings.merge.tree_tops)
    return line if rule is None else f"{line}; {write_tops(outputs['values'], rule, outputs)}"


def quicklook(scene: Scene, settings: Settings, png: str | Path, title: str) -> None:
    render_values_quicklook(scene.outputs["values"], png, title=title)


def counts(scene: Scene, labels: Sequence[str]) -> dict[str, int]:
    return count_values(scene.outputs["values"], list(labels))


# an exported regression model gives a channel per value, in the values' own units
CARD = CardRules("regression", ("values",))


def regression_model(settings: Settings, check: bool = True) -> RegressorConfig | ModelCard:
    """The config's regression model: an exported file's card (checked against the file when ``check``), else
    the regressor that the keys and the model file make."""
    return exported_card(settings, CARD, check) or regressor_of_config(settings)


def labels(settings: Settings) -> list[str]:
    return list(regression_model(settings).labels)


def model_input(settings: Settings) -> InputBands:
    return regression_model(settings).input


def check_annotations(path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str) -> None:
    if label_column:
        raise InputError(
            f"{path}: label_column is set ({label_column}) but a regression target is a raster of values, one band "
            "per model.labels: leave label_column out"
        )
    check_targets(path, raster, labels)


def check_scene_keys(scene: SceneSettings, key_of: Callable[[str], str]) -> None:
    """The dry run's check of a scene's true tree tops (``scenes.X.tree_tops``), read as its scoring reads them
    (:func:`read_tree_tops`): a local file that exists and holds points in a CRS. A remote one is read when scored
    (GDAL's /vsicurl/ names only rasters in a process that reads remote rasters: remote.ALLOWED_EXTENSIONS)."""
    tops = scene.tree_tops
    if not tops or is_remote(tops):
        return
    if not Path(tops).exists():
        raise InputError(f"{tops}: tree tops not found ({key_of('tree_tops')})")
    read_tree_tops(tops)


REGRESSION = TaskSpec(
    name="regression",
    rank_suffix=".tif",
    scene_outputs=lambda settings: {"values": VALUES, **tree_top_outputs(settings)},
    evaluated_output="values",
    model_files=MODEL_FILES,
    default_model_name="regressor",
    labels=labels,
    check_annotations=check_annotations,
    merge=merge,
    evaluate=evaluate,
    summarize=summarize,
    project_outputs=lambda settings: {"values": "values.vrt", **tree_top_outputs(settings)},
    merge_project=merge_project,
    quicklook=quicklook,
    counts=counts,
    count_unit="pixels",
    implementation="rasterscale.tasks.regression.task:RegressionTask",
    model_input=model_input,
    config_keys={
        "model": ("loss", "architecture", "encoder", "encoder_weights", "card"),
        "merge": ("tree_tops",),
        "evaluate": ("tree_top_distance",),
    },
    scene_keys=("tree_tops",),
    check_scene_keys=check_scene_keys,
    schema_enums={"model.loss": LOSSES, "model.architecture": ARCHITECTURES},
    exported_outputs=CARD.outputs,
    cog_layers=True,
    project_summary="values",
)
