"""The basis of the memory estimates of the workflow's CPU jobs in MB (each step's ``mem_mb``, its rule's
``resources: mem_mb``: :mod:`rasterscale.workflow.steps`), made from the plan's sizes before any job runs: what a
Slurm job asks for (``--mem``, over the profile's ``default-resources``) and what a local run schedules by when it
is given ``--resources mem_mb=N``.

Each estimate is a job process's own size (:data:`PROCESS_MB`) plus what the job holds at its peak, by the basis
its step's docstring names, times :data:`HEADROOM`, rounded up to :data:`STEP_MB` (:func:`job_mb`). A scene's size
is its footprint in the plan (the predicted scenes' headers), else its demo size (a synthesized scene), else
:data:`UNKNOWN_SIDE` pixels a side (a training-only scene: the plan keeps no footprint of it); a seam's mosaic
counts as its two scenes side by side. The DDP jobs (training, prediction, the environment check) are not
estimated here: theirs is ``slurm.mem_mb`` per node (:mod:`rasterscale.runtime.launchers`). A rule's estimate can be
overridden per rule with Snakemake's ``--set-resources RULE:mem_mb=N``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from rasterscale.grid.project import Footprint, is_seam, seam_scenes
from rasterscale.raster.imagery import PERCENTILE_SIDE
from rasterscale.workflow.plan import Plan

MB = 2**20
STEP_MB = 100  # estimates are rounded up to a multiple of this
HEADROOM = 1.5  # over the estimate: allocator fragmentation, GDAL's and Arrow's buffers, copies not counted
PROCESS_MB = 300  # a job's Python with numpy, GDAL (rasterio), GEOS, geopandas, pyarrow, matplotlib: 160-240 measured
ROW_BYTES = 1200  # a tile or box as a GeoDataFrame row with its polygon, then as Arrow: 1.1 KB measured (500k tiles)
OUTLINE_ROW_BYTES = 4000  # an instance's outline (about 100 vertices, as shapely and as WKB) with its row
OBJECTS_PER_TILE = 100  # a dense stand's objects above the score threshold in a tile, unless detections_per_tile
DECIMATED_BYTES = 1 + 3 * 8  # per pixel of a decimated read besides its bands: the mask, a band as float64 thrice
DENSE_ROW_BYTES = 1024 * 8  # a dense task's merge, per pixel of the scene's width: a row of 1024 px blocks
DENSE_FIXED_MB = 256  # a dense merge: its blocks, GDAL's caches (16 MB; its COG's: 5% of the job's), vertex budget
QUICKLOOK_MB = 100  # a quicklook: the scene's bands read at 1600 px a side and matplotlib's figure
UNKNOWN_SIDE = 50_000  # pixels a side of a scene of unknown size
UNKNOWN_BANDS = 4
UNKNOWN_ITEMSIZE = 2  # uint16


@dataclass(frozen=True)
class SceneSize:
    """What the estimates need of a scene's raster: its pixels across and down, bands and bytes per value."""

    width: int
    height: int
    bands: int
    itemsize: int


@functools.cache
def itemsize(dtype: str) -> int:
    """Bytes of a value of a raster's data type (by name: "uint8", "float32", ...)."""
    return np.dtype(dtype).itemsize


def scene_size(plan: Plan, name: str) -> SceneSize:
    """A scene's size: its footprint, else its demo size, else :data:`UNKNOWN_SIDE` square; a seam's mosaic: its
    two scenes side by side."""
    if is_seam(name):
        a, b = (scene_size(plan, scene) for scene in seam_scenes(name))
        return SceneSize(a.width + b.width, max(a.height, b.height), max(a.bands, b.bands), max(a.itemsize, b.itemsize))
    footprint = plan.footprints.get(name)
    if footprint is not None:
        return footprint_size(footprint)
    demo = plan.settings.demo.scenes.get(name)
    if demo is not None:
        return SceneSize(demo.width, demo.height, 4 if demo.nir else 3, 1)
    return SceneSize(UNKNOWN_SIDE, UNKNOWN_SIDE, UNKNOWN_BANDS, UNKNOWN_ITEMSIZE)


@functools.lru_cache(maxsize=2**18)
def footprint_size(footprint: Footprint) -> SceneSize:
    """A scene's size from its footprint (kept: every estimate of a batch or partition asks for its scenes')."""
    (xmin, ymin, xmax, ymax), (px, py) = footprint.bounds, footprint.pixel
    width, height = max(1, round((xmax - xmin) / px)), max(1, round((ymax - ymin) / py))
    return SceneSize(width, height, footprint.count, itemsize(footprint.dtype))


def tiles_along(length: int, patch_size: int, overlap: int) -> int:
    """How many tiles cover ``length`` pixels: ``len(tile_offsets(...))`` (rasterscale.grid.manifest), counted."""
    if length <= patch_size:
        return 1
    return math.ceil((length - patch_size) / (patch_size - overlap)) + 1


def tiles(plan: Plan, size: SceneSize) -> int:
    """The tiles of a scene of this size on the config's grid (tiling.patch_size, tiling.overlap)."""
    tiling = plan.settings.tiling
    across = tiles_along(size.width, tiling.patch_size, tiling.overlap)
    return across * tiles_along(size.height, tiling.patch_size, tiling.overlap)


def job_mb(held_bytes: float) -> int:
    """A job's estimate: its process and what it holds, times :data:`HEADROOM`, rounded up to :data:`STEP_MB`."""
    total = (PROCESS_MB + held_bytes / MB) * HEADROOM
    return int(math.ceil(total / STEP_MB) * STEP_MB)


def decimated_read_bytes(size: SceneSize) -> int:
    """A read of the whole scene decimated to at most 2048 px a side (PERCENTILE_SIDE; a manifest's mask and a
    percentile stretch or statistics read no more): its bands and mask, and a band as float64 with its valid
    values and the percentile's sorted copy."""
    factor = max(1, math.ceil(max(size.width, size.height) / PERCENTILE_SIDE))
    pixels = math.ceil(size.width / factor) * math.ceil(size.height / factor)
    return pixels * (size.bands * size.itemsize + DECIMATED_BYTES)


def manifest_bytes(plan: Plan, name: str) -> int:
    """What a scene's (or seam's) tile manifest holds: its decimated read (the tiles' pixels are read later, a window
    at a time, by prediction: never here) and its rows, as a GeoDataFrame and as Arrow."""
    size = scene_size(plan, name)
    return decimated_read_bytes(size) + tiles(plan, size) * ROW_BYTES


def objects_per_tile(plan: Plan) -> int:
    """Objects a tile yields: model.detections_per_tile when set (a bound), else :data:`OBJECTS_PER_TILE`."""
    return plan.settings.model.detections_per_tile or OBJECTS_PER_TILE


def objects_bytes(plan: Plan, size: SceneSize) -> int:
    """A scene's objects as rows (boxes, or outlines for instances), duplicates across tile overlaps included."""
    row = OUTLINE_ROW_BYTES if plan.task.outlines else ROW_BYTES
    return tiles(plan, size) * objects_per_tile(plan) * row


def dense_merge_bytes(size: SceneSize) -> int:
    """A dense task's merge (segmentation, regression), block by block: a row of blocks across the scene and
    :data:`DENSE_FIXED_MB`, whatever its height."""
    return size.width * DENSE_ROW_BYTES + DENSE_FIXED_MB * MB


def is_dense(plan: Plan) -> bool:
    """Whether the task's ranks write rasters (merged block by block) rather than objects."""
    return plan.task.rank_suffix == ".tif"


def merge_bytes(plan: Plan, name: str) -> int:
    """What merging one scene (or seam) holds: its ranks' objects and the merged layer (twice the objects), or a
    dense task's blocks."""
    size = scene_size(plan, name)
    return dense_merge_bytes(size) if is_dense(plan) else 2 * objects_bytes(plan, size)


def mosaic_width(plan: Plan) -> int:
    """Pixels across the predicted scenes' union (their footprints' extent at the finest pixel): a dense project's
    mosaic."""
    footprints = [plan.footprints[name] for name in plan.predict_scenes if name in plan.footprints]
    if not footprints:
        return max((scene_size(plan, name).width for name in plan.predict_scenes), default=0)
    left, right = min(f.bounds[0] for f in footprints), max(f.bounds[2] for f in footprints)
    return max(1, round((right - left) / min(f.pixel[0] for f in footprints)))


def objects_of(plan: Plan, names: Iterable[str]) -> int:
    """What a job holding these scenes' and seams' objects at once holds: each one's ranks' objects and the
    merged layer (twice the objects)."""
    return sum(2 * objects_bytes(plan, scene_size(plan, name)) for name in names)
