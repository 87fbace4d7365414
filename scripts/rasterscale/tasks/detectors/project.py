"""A project layer of objects (detection's boxes, instances' crowns): every predicted scene's and seam's merged
objects in one layer, in the project's CRS, each object once.

Each source keeps the objects centred where it owns the map (:class:`rasterscale.grid.project.Ownership`): a
crown on a border between two scenes comes from their seam, whose tiles saw it whole. The duplicates left where two
owners meet (the same crown found by a scene and by a seam, its centre a little to either side of the core's edge)
are the task's to remove, by its own overlap measure, among pairs from different sources or scenes
(:func:`apart`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd
import shapely

from rasterscale.atomic import write_geoparquet, write_gpkg
from rasterscale.grid.project import Ownership, is_seam, source_area
from rasterscale.scene import ProjectJobFields, ProjectSource

PROJECT_COLUMNS = ["scene", "source", "label", "score", "geometry"]
# GeoParquet 1.1 with its bbox covering column: readers filter row groups by it without decoding a geometry
COVERING: dict[str, Any] = {"write_covering_bbox": True, "schema_version": "1.1.0", "row_group_size": 65536}


def ownership_of(sources: Sequence[ProjectSource], crs: str) -> Ownership:
    footprints: dict[str, shapely.Geometry] = {}
    cores: dict[str, shapely.Geometry] = {}
    for source in sources:
        area = source_area(source, crs)
        if area is not None:
            (cores if is_seam(source.name) else footprints)[source.name] = area
    return Ownership(footprints, cores)


def owned_objects(source: ProjectSource, crs: str, ownership: Ownership) -> gpd.GeoDataFrame:
    """A source's merged objects (its GeoParquet layer) in the project's CRS, those it owns, with their scene and
    source (:data:`PROJECT_COLUMNS`)."""
    frame = gpd.read_parquet(source.outputs["parquet"])
    frame = frame.set_crs(source.crs or crs, allow_override=frame.crs is None)
    if frame.crs != crs:
        frame = frame.to_crs(crs)
    name = source.name
    frame = frame.assign(scene=name, source=name)[PROJECT_COLUMNS]
    if len(frame) and (name in ownership.footprints or name in ownership.cores):
        centres = frame.geometry.centroid
        x, y = centres.x.to_numpy(), centres.y.to_numpy()
        frame = frame.assign(scene=ownership.scene_of(name, x, y))[ownership.keeps(name, x, y)]
    return frame


def owned_layer(job: ProjectJobFields) -> tuple[gpd.GeoDataFrame, int]:
    """Every source's owned objects of a project's job in one frame (project CRS), and how many they are. A
    partition's job (:mod:`rasterscale.grid.partitions`) also gives the ``areas`` of its neighbours' neighbours,
    whose objects it does not read."""
    crs = job.crs
    ownership = ownership_of([*job.sources, *job.areas], crs)
    frames = [owned_objects(source, crs, ownership) for source in job.sources]
    present = [f for f in frames if len(f)] or frames[:1]
    frame = gpd.GeoDataFrame(pd.concat(present, ignore_index=True), geometry="geometry", crs=crs)
    return frame, sum(len(f) for f in frames)


def apart(frame: gpd.GeoDataFrame, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Which pairs (i, j) of a project frame's rows may be duplicates: same label, from different sources or
    scenes (a seam's objects on the two sides of its border too)."""
    sources = pd.factorize(frame["source"])[0]
    scenes = pd.factorize(frame["scene"])[0]
    labels = pd.factorize(frame["label"])[0]
    return ((sources[i] != sources[j]) | (scenes[i] != scenes[j])) & (labels[i] == labels[j])


def summary(job: ProjectJobFields, kept: int, owned: int, unit: str, output: str) -> str:
    """The project merge's line for the log (a partition's: its owners' objects, of those it read)."""
    owners = job.owners or [source.name for source in job.sources]
    seams = sum(is_seam(name) for name in owners)
    read = f"{owned} owned, {owned - kept} duplicates across sources"
    if job.owners:
        read = f"{owned} owned by them and {len(job.sources) - len(owners)} neighbouring sources, {kept} theirs"
    return f"{kept} {unit} from {len(owners) - seams} scenes and {seams} seams ({read}) -> {output}"


def write_project(job: ProjectJobFields, frame: gpd.GeoDataFrame, owned: int, unit: str, layer: str) -> str:
    """Write a project's merged objects: a partition's job (``owners`` set) its owners' objects to one GeoParquet
    file of the partitioned layer, in Hilbert order (each row group a compact area: a reader's bbox filter skips
    the others); else the whole layer as GeoParquet and GeoPackage. Both with GeoParquet 1.1's ``bbox`` covering
    column. A line for the log."""
    outputs = job.outputs
    owners = job.owners
    if owners:
        frame = frame[frame["source"].isin(owners)]
        if len(frame):
            frame = frame.iloc[np.argsort(frame.geometry.hilbert_distance(), kind="stable")]
        frame = frame.reset_index(drop=True)
        output = outputs["partition"]
        write_geoparquet(frame, output, **COVERING)
    else:
        output = outputs["parquet"]
        write_geoparquet(frame, output, **COVERING)
        write_gpkg(frame, outputs["gpkg"], layer=layer)
    return summary(job, len(frame), owned, unit, output)
