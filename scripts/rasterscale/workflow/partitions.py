"""The project's layer and summary in the plan: whether the layer is partitioned (a task of objects, more predicted
scenes than ``project.partition_scenes``), its files (one a batch holding project sources:
``results/{run}/project/{layer}/batch-{b}.parquet``), what each partition's job reads (its batch's sources'
objects and their neighbours', :mod:`rasterscale.grid.partitions`) and depends on (the merge records of the
batches holding them), and the summary raster (:mod:`rasterscale.raster.summary`) over the layer.

A partition's job depends on its neighbours' batches' merge records and its job file lists its neighbourhood: a
batch of new scenes reruns the partitions of the batches beside it (their ownership changes), no other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import shapely

from rasterscale.grid.partitions import Neighbourhood, area_neighbourhoods
from rasterscale.grid.project import is_seam, source_area
from rasterscale.scene import ProjectSource

if TYPE_CHECKING:
    from rasterscale.workflow.plan import Plan

SUMMARY = "summary.tif"


def partitioned(plan: Plan) -> bool:
    """Whether the project's layer is a partitioned GeoParquet dataset."""
    objects = plan.task.project_summary == "objects"
    return plan.has_project() and objects and plan.predicted_count > plan.settings.project.partition_scenes


def layer_name(plan: Plan) -> str:
    """The project layer's name (``detections``, ``crowns``): its GeoParquet file's stem, its partitions' folder."""
    return Path(plan.task.project_outputs(plan.settings)["parquet"]).stem


def partition_file(plan: Plan, batch: int | str) -> str:
    return plan.paths.project_file(f"{layer_name(plan)}/batch-{batch}.parquet")


def summary_file(plan: Plan) -> str:
    return plan.paths.project_file(SUMMARY)


def summary_layers(plan: Plan) -> list[str]:
    """What the summary raster reads: the partitions, the layer's GeoParquet file, or a raster task's mosaic."""
    if partitioned(plan):
        return [partition_file(plan, batch) for batch in partition_groups(plan)]
    kind = plan.task.project_summary
    return [plan.paths.project_file(plan.task.project_outputs(plan.settings)["parquet" if kind == "objects" else kind])]


def source_entry(plan: Plan, name: str, outputs: bool = True) -> ProjectSource:
    """A project source as a project job lists it: its name, CRS and footprint (a scene's ``bounds``) or core (a
    seam's), and (``outputs``) its merged layers by key."""
    layers = plan.scene_outputs(name) if outputs else {}
    if is_seam(name):
        seam = plan.seam(name)
        return ProjectSource(name, plan.footprints[seam.a].crs, core=seam.core, outputs=layers)
    footprint = plan.footprints.get(name)
    if footprint is None:
        return ProjectSource(name, outputs=layers)
    return ProjectSource(name, footprint.crs, footprint.bounds, outputs=layers)


def partition_groups(plan: Plan) -> dict[int, list[str]]:
    """The batches holding project sources, with those sources (a batch holding none has no partition)."""
    sources = set(plan.project_sources())
    groups = {batch: [name for name in names if name in sources] for batch, names in plan.members.items()}
    return {batch: names for batch, names in sorted(groups.items()) if names}


def partition_neighbourhoods(plan: Plan) -> dict[int, Neighbourhood]:
    """Each partition's :class:`~rasterscale.grid.partitions.Neighbourhood` (the plan keeps them:
    ``Plan.partition_neighbourhoods``)."""
    pixel = max((max(footprint.pixel) for footprint in plan.footprints.values()), default=0.0)
    return area_neighbourhoods(partition_groups(plan), source_areas(plan), pixel / 100)


def source_areas(plan: Plan) -> dict[str, Any]:
    """Each project source's area in the project's CRS (:func:`~rasterscale.grid.project.source_area` of its
    :func:`source_entry`; a scene whose header the plan did not read has none), those already in that CRS all at
    once (shapely's array functions: a seam's core read from its WKT, a scene's box from its bounds)."""
    crs = plan.project_crs()
    cores: dict[str, str] = {}
    bounds: dict[str, tuple[float, float, float, float]] = {}
    areas: dict[str, Any] = {}
    for name in plan.project_sources():
        if is_seam(name):
            seam = plan.seam(name)
            if plan.footprints[seam.a].crs == crs:
                cores[name] = seam.core
                continue
        elif (footprint := plan.footprints.get(name)) is None:
            continue  # no header read: no area
        elif footprint.crs == crs:
            bounds[name] = footprint.bounds
            continue
        area = source_area(source_entry(plan, name, outputs=False), crs)
        if area is not None:
            areas[name] = area
    areas.update(zip(cores, shapely.from_wkt(np.array(list(cores.values()), dtype=object)), strict=True))
    boxes = np.array(list(bounds.values()), dtype=np.float64).reshape(-1, 4)
    areas.update(zip(bounds, shapely.box(*boxes.T), strict=True))
    return areas
