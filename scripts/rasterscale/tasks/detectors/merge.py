"""The cross-tile merge of the tasks that find objects (detection's boxes, instances' crowns), whatever an
object's shape: which objects are *cut* by an inner tile edge, greedy NMS over a sparse list of suppressing pairs
(never all pairs), rank files written (atomically) and a scene's read as one frame, the objects on valid pixels,
merged across tiles by the task's merge and written as the scene's layer (:func:`merge_scene`); and a merged layer's
counts by label.

The pairs and their overlaps are the task's (box IoU, polygon IoU); the merge here is numpy over those arrays. The
scores against ground truth are :mod:`rasterscale.tasks.detectors.metrics`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
from geopandas.io.arrow import _geopandas_to_arrow

from rasterscale.atomic import atomic_path, write_geoparquet, write_gpkg
from rasterscale.grid.manifest import read_manifest
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.raster.imagery import ImageSpec, on_data, read_spec
from rasterscale.settings import MergeSettings

BOX_COLUMNS = ["px_xmin", "px_ymin", "px_xmax", "px_ymax"]  # an object's box in raster pixels, in every frame


# A task's merge of a scene's objects across tile overlaps: (objects, manifest, raster width, raster height,
# merge.iou_threshold, merge.edge_tolerance, merge.containment_threshold) -> one row per object, sorted by score
CrossTileMerge = Callable[[gpd.GeoDataFrame, gpd.GeoDataFrame, int, int, float, float, float], gpd.GeoDataFrame]


def cut_by_inner_edge(
    boxes: np.ndarray, windows: np.ndarray, raster_width: int, raster_height: int, tolerance: float
) -> np.ndarray:
    """True for boxes touching an edge of their tile that is not the raster's edge (the object may go on)."""
    col, row, width, height = (windows[:, k] for k in range(4))
    left = (col > 0) & (boxes[:, 0] <= col + tolerance)
    top = (row > 0) & (boxes[:, 1] <= row + tolerance)
    right = (col + width < raster_width) & (boxes[:, 2] >= col + width - tolerance)
    bottom = (row + height < raster_height) & (boxes[:, 3] >= row + height - tolerance)
    return left | top | right | bottom


def greedy_nms(scores: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Keep-mask of greedy NMS given the suppressing pairs (i, j): a box is dropped when a kept box of higher
    score (ties: lower index) suppresses it, as in torchvision's NMS.

    Decided in rounds over the sparse pair list instead of box by box: each round suppresses the boxes that a
    kept box suppresses and keeps those whose higher-scoring neighbours are all suppressed. The best undecided
    box is always decided, so the rounds end; they are as many as the longest chain of overlaps (a handful).
    """
    n = len(scores)
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((np.arange(n), -np.asarray(scores)))] = np.arange(n)
    first = rank[i] < rank[j]
    high, low = np.where(first, i, j), np.where(first, j, i)
    state = np.zeros(n, dtype=np.int8)  # 0 undecided, 1 kept, -1 suppressed
    while True:
        pending = state[low] == 0
        high, low = high[pending], low[pending]
        state[low[state[high] == 1]] = -1
        blocked = np.zeros(n, dtype=bool)
        blocked[low[state[high] == 0]] = True
        state[(state == 0) & ~blocked] = 1
        if not blocked.any():
            return state == 1


# a task's choice of the objects to keep across tile overlaps: (objects, their boxes in raster pixels, which are cut
# by an inner tile edge, merge.iou_threshold, merge.containment_threshold) -> the indexes of the objects kept
KeepAcrossTiles = Callable[[gpd.GeoDataFrame, np.ndarray, np.ndarray, float, float], np.ndarray]


def merge_across_tiles(
    keep: KeepAcrossTiles,
    objects: gpd.GeoDataFrame,
    manifest: pd.DataFrame,
    raster_width: int,
    raster_height: int,
    iou_threshold: float,
    edge_tolerance: float,
    containment_threshold: float,
) -> gpd.GeoDataFrame:
    """A scene's objects without the duplicates that tile overlaps create, sorted by score: those ``keep`` keeps,
    given which are cut by an inner tile edge (their box within ``edge_tolerance`` px of an edge of their tile that
    is not the raster's: :func:`cut_by_inner_edge`). A task's cross-tile merge binds its ``keep``
    (:func:`functools.partial`)."""
    if len(objects) == 0:
        return objects.reset_index(drop=True)
    windows = manifest.set_index("tile_id").loc[objects["tile_id"], ["col_off", "row_off", "width", "height"]]
    boxes = objects[BOX_COLUMNS].to_numpy(dtype=np.float64)
    cut = cut_by_inner_edge(boxes, windows.to_numpy(), raster_width, raster_height, edge_tolerance)
    kept = keep(objects, boxes, cut, iou_threshold, containment_threshold)
    merged = objects.iloc[kept].sort_values("score", ascending=False, kind="stable")
    return merged.reset_index(drop=True)


def count_labels(path: str | Path, labels: Sequence[str]) -> dict[str, int]:
    """A merged layer's objects per label: each of ``labels`` (0 when it has none), then any other label the
    layer holds. Only its label column is read."""
    column = pq.read_table(path, columns=["label"]).column("label")
    found = {str(item["values"]): int(item["counts"]) for item in pc.value_counts(column).to_pylist()}
    return {**{label: found.pop(label, 0) for label in labels}, **found}


def write_objects_file(objects: gpd.GeoDataFrame, columns: Sequence[str], path: str | Path) -> None:
    """GeoParquet of objects in a rank file's ``columns``, atomically."""
    table = _geopandas_to_arrow(objects[list(columns)].reset_index(drop=True))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_rank_files(paths: Sequence[str | Path], empty: Callable[[Any], gpd.GeoDataFrame]) -> gpd.GeoDataFrame:
    """A scene's rank files (GeoParquet) as one frame; ``empty(crs)`` where none holds a row."""
    frames = [gpd.read_parquet(p) for p in paths]
    crs = next((f.crs for f in frames if f.crs is not None), None)
    non_empty = [f for f in frames if len(f)]
    objects = pd.concat(non_empty, ignore_index=True) if non_empty else empty(crs)
    return gpd.GeoDataFrame(objects, geometry="geometry", crs=crs)


def drop_masked(objects: gpd.GeoDataFrame, path: str | Path, spec: ImageSpec) -> gpd.GeoDataFrame:
    """The objects whose box (:data:`BOX_COLUMNS`) is centred on a valid pixel (a tile partly masked may still
    see an object in its fill)."""
    if spec.mask == "none" or not len(objects):
        return objects
    return objects[on_data(path, spec, objects[BOX_COLUMNS].to_numpy())]


def merge_rank_files(
    rank_files: Sequence[str | Path],
    manifest_path: str | Path,
    raster_path: str | Path,
    settings: MergeSettings,
    empty: Callable[[Any], gpd.GeoDataFrame],
    merge: CrossTileMerge,
) -> tuple[gpd.GeoDataFrame, RasterInfo]:
    """A scene's rank files (their records already checked: :mod:`rasterscale.jobs.rankfiles`), the objects on
    valid pixels, merged across tile overlaps with ``merge.*`` (``settings``); the merged frame and the scene's
    raster."""
    manifest = read_manifest(manifest_path)
    raster = check_raster(raster_path)
    objects = drop_masked(read_rank_files(rank_files, empty), raster_path, read_spec(manifest_path))
    thresholds = (settings.iou_threshold, settings.edge_tolerance, settings.containment_threshold)
    merged = merge(objects, manifest, raster.width, raster.height, *thresholds)
    return merged, raster


@dataclass(frozen=True)
class SceneLayer:
    """How a task's rank files become a scene's layer: ``empty(crs)`` is the frame of no objects, ``merge`` the
    cross-tile merge of the rank files' rows, ``rows(merged, crs)`` the layer's rows from the merged ones, in the
    raster's CRS; ``name`` is the GeoPackage's layer."""

    empty: Callable[[Any], gpd.GeoDataFrame]
    merge: CrossTileMerge
    rows: Callable[[gpd.GeoDataFrame, Any], gpd.GeoDataFrame]
    name: str


def merge_scene(
    layer: SceneLayer,
    rank_files: Sequence[str | Path],
    manifest_path: str | Path,
    raster_path: str | Path,
    gpkg_path: str | Path,
    parquet_path: str | Path,
    settings: MergeSettings,
) -> gpd.GeoDataFrame:
    """Merge a scene's rank files (their records already checked: :mod:`rasterscale.jobs.rankfiles`) across tile
    overlaps (:func:`merge_rank_files`); write its ``layer`` as GeoParquet and GeoPackage (atomically); its rows. A
    task's ``merge_scene`` binds its layer (:func:`functools.partial`)."""
    merged, raster = merge_rank_files(rank_files, manifest_path, raster_path, settings, layer.empty, layer.merge)
    rows = layer.rows(merged, raster.crs)
    write_geoparquet(rows, parquet_path)
    write_gpkg(rows, gpkg_path, layer=layer.name)
    return rows
