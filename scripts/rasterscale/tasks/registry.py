"""The tasks rasterscale knows: one line per task. A task is a folder under ``rasterscale/tasks/`` with a torch-free
``spec`` (:class:`~rasterscale.tasks.spec.TaskSpec`) and its torch half (``task``); adding one is its folder and
its line here. The schema's ``task`` values, the keys only one task reads and the workflow's outputs all come
from here. What a task folder's modules are called, by role, and what the tasks share: ``tasks/README.md``."""

from __future__ import annotations

from rasterscale.tasks.detection.spec import DETECTION
from rasterscale.tasks.instances.spec import INSTANCES
from rasterscale.tasks.points.spec import POINTS
from rasterscale.tasks.regression.spec import REGRESSION
from rasterscale.tasks.segmentation.spec import SEGMENTATION
from rasterscale.tasks.spec import TaskSpec

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (DETECTION, SEGMENTATION, INSTANCES, REGRESSION, POINTS)}


def task_spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (one of {', '.join(TASKS)})")
    return TASKS[name]
