"""Tasks as plugins: a task is its folder and its line in rasterscale.tasks.registry. The schema takes the task
values and each task's own enums from the registry, each spec loads its torch half, and nothing outside a task's
folder (the package, the rules, the Snakefile) names a task."""

from __future__ import annotations

import ast
import re

import pytest

from conftest import REPO
from rasterscale.config.schema import load_schema, validate_config
from rasterscale.errors import ConfigError
from rasterscale.tasks.api import Task
from rasterscale.tasks.registry import TASKS, task_spec
from rasterscale.tasks.segmentation.modelfiles import ARCHITECTURES

PACKAGE = REPO / "scripts" / "rasterscale"


def test_the_schema_takes_the_task_values_and_the_tasks_enums_from_the_registry():
    schema = load_schema()
    assert (
        schema["properties"]["task"]["enum"]
        == list(TASKS)
        == ["detection", "segmentation", "instances", "regression", "points"]
    )
    assert schema["properties"]["model"]["properties"]["architecture"]["enum"] == [None, *ARCHITECTURES]
    with pytest.raises(ConfigError, match="'task'"):
        validate_config({"task": "panoptic"})


@pytest.mark.parametrize("name", list(TASKS))
def test_each_spec_loads_its_torch_half_which_points_back_to_it(name):
    spec = task_spec(name)
    task = spec.load()
    assert isinstance(task, Task) and type(task).spec is spec
    assert validate_config({"task": name})["model"]["name"] == spec.default_model_name


@pytest.mark.parametrize(
    ("task", "section", "key", "value", "owner"),
    [
        ("segmentation", "model", "score_threshold", 0.5, "detection, instances and points"),
        ("detection", "model", "architecture", "fpn", "segmentation, regression and points"),
        ("instances", "model", "encoder", "resnet34", "segmentation, regression and points"),
        ("detection", "model", "encoder_weights", "s2.pth", "segmentation, regression and points"),
        ("detection", "model", "mask_threshold", 0.5, "instances"),
        ("instances", "evaluate", "iou_threshold", 0.5, "detection"),
        ("segmentation", "evaluate", "mask_iou_threshold", 0.5, "instances"),
        ("segmentation", "model", "loss", "mse", "regression and points"),
        ("regression", "predict", "probabilities", True, "segmentation"),
        ("regression", "model", "fpn_channels", 128, "detection and instances"),
        ("detection", "merge", "tree_tops", {"min_height": 2}, "regression"),
        ("segmentation", "evaluate", "tree_top_distance", 0.5, "regression"),
        ("regression", "merge", "point_distance", 0.5, "points"),
        ("detection", "evaluate", "point_distance", 0.5, "points"),
        ("segmentation", "model", "sigma", 0.5, "points"),
    ],
)
def test_a_key_only_another_task_reads_is_refused_naming_both(task, section, key, value, owner):
    for name in re.split(", | and ", owner):
        assert key in task_spec(name).config_keys[section]  # the key is the owners', by their specs
        validate_config({"task": name, section: {key: value}})  # and valid there
    with pytest.raises(ConfigError, match=f"'{section}.{key}' applies to task {owner} only, and task is {task}"):
        validate_config({"task": task, section: {key: value}})


def test_a_scene_key_only_another_task_reads_is_refused_naming_both():
    assert task_spec("regression").scene_keys == ("tree_tops",)
    scenes = {"a": {"path": "a.tif", "tree_tops": "tops.gpkg"}}
    validate_config({"task": "regression", "scenes": scenes})
    with pytest.raises(
        ConfigError, match=r"'scenes\.a\.tree_tops' applies to task regression only, and task is detection"
    ):
        validate_config({"task": "detection", "scenes": scenes})


def task_names_in_python(path) -> list[str]:
    """String constants of a module equal to a task's name (docstrings and comments may speak of tasks)."""
    tree = ast.parse(path.read_text())
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in TASKS
    ]


def test_nothing_outside_a_tasks_folder_names_a_task():
    folders = [PACKAGE / "tasks" / name for name in TASKS]
    named = {
        str(path.relative_to(REPO)): found
        for path in PACKAGE.rglob("*.py")
        if not any(folder in path.parents for folder in folders)
        for found in [task_names_in_python(path)]
        if found
    }
    pattern = re.compile(r"[\"'](" + "|".join(TASKS) + r")[\"']")
    for path in [REPO / "Snakefile", *(REPO / "rules").glob("*.smk")]:
        found = pattern.findall(path.read_text())
        if found:
            named[str(path.relative_to(REPO))] = found
    assert not named, f"task names outside their folders: {named}"
    assert task_names_in_python(PACKAGE / "tasks" / "detection" / "spec.py")  # the scan sees a task's own name
