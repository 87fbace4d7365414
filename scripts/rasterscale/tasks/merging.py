"""Merging rank rasters into a scene's layers (torch-free): what the merges of the tasks that predict a value per
pixel share (segmentation's classes and probabilities, regression's values), and their project's mosaic.

A scene's merge opens the scene's raster and the rank rasters (:func:`open_merge_sources`), each placed on the
scene's grid (:func:`rank_window`), and reads them block by block (:func:`block_windows`; :func:`claimed_pieces`
says which rank raster holds which pixel), masked pixels from the scene's imagery (:func:`window_valid_mask`). It
writes each layer into an uncompressed scratch raster beside it (:func:`open_layer`, in :func:`scratch_path`),
tiled as the layer's COG is, which becomes the COG (:meth:`ScratchLayer.finish`,
:func:`rasterscale.raster.cog.cog_of_scratch`). :func:`finish_layers` makes a scene's layers COGs side by side on
the job's cores, and runs what reads the finished scratch rasters meanwhile (segmentation's polygons). A project's
layer is a VRT over its scenes' and seams' merged rasters (:func:`write_project_mosaic`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import rasterio
from rasterio.windows import Window

from rasterscale.atomic import check_written, writing
from rasterscale.errors import InputError
from rasterscale.grid.project import is_seam
from rasterscale.raster.cog import BLOCK_SIZE, cog_of_scratch, scratch_profile
from rasterscale.raster.imagery import ImageSpec, decoding, read_masked
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.raster.remote import open_raster
from rasterscale.raster.windows import intersection
from rasterscale.scene import ProjectJobFields

# GDAL's block cache while merging or vectorizing: each block is read once, and GDAL's default (5% of the node's
# memory) would fill up with blocks never read again
CACHE_MB = 16

T = TypeVar("T")
Resampling = Literal["mode", "average"]  # a layer's overviews: the most frequent class, or the mean value


@contextlib.contextmanager
def scratch_path(near: Path, name: str) -> Iterator[Path]:
    """A temporary file next to ``near`` (same file system), removed afterwards whatever happens; a full file system
    on the way is a DiskFullError naming ``near`` (:func:`rasterscale.atomic.writing`)."""
    path = near.with_name(f".{near.stem}.{name}-{os.getpid()}.tif")
    try:
        with writing(near):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield path
    finally:
        path.unlink(missing_ok=True)


def rank_window(src: rasterio.io.DatasetReader, scene: rasterio.io.DatasetReader, path: str | Path) -> Window:
    """Where a rank raster lies in the scene's pixel grid; one that is not on the grid fails naming the file."""
    t, s = src.transform, scene.transform
    col, row = (t.c - s.c) / s.a, (t.f - s.f) / s.e
    if (
        src.crs != scene.crs
        or not np.allclose((t.a, t.b, t.d, t.e), (s.a, s.b, s.d, s.e))
        or abs(col - round(col)) > 1e-6
        or abs(row - round(row)) > 1e-6
    ):
        raise ValueError(f"{path}: rank raster is not on the scene's pixel grid (CRS, resolution or offset)")
    window = Window(round(col), round(row), src.width, src.height)
    if (
        window.col_off < 0
        or window.row_off < 0
        or window.col_off + window.width > scene.width
        or window.row_off + window.height > scene.height
    ):
        raise ValueError(f"{path}: rank raster reaches outside the scene ({window} in {scene.width}x{scene.height})")
    return window


def open_merge_sources(
    stack: contextlib.ExitStack,
    raster_path: str | Path,
    rank_rasters: Sequence[str | Path],
    cache_mb: int,
    bands: tuple[int, str] | None,
) -> tuple[rasterio.io.DatasetReader, list[tuple[str, rasterio.io.DatasetReader, Window]]]:
    """What a scene's merge reads, opened in ``stack`` under a GDAL block cache of ``cache_mb`` MB: the scene's
    raster, and each rank raster as (its path, its reader, its window on the scene: :func:`rank_window`).
    ``bands``: how many bands a rank raster must have, and what they are for the error (None: not checked)."""
    stack.enter_context(rasterio.Env(GDAL_CACHEMAX=cache_mb * 2**20))
    scene = stack.enter_context(open_raster(raster_path))
    ranks = []
    for path in rank_rasters:
        src = stack.enter_context(rasterio.open(path))
        if bands is not None and src.count != bands[0]:
            raise ValueError(f"{path}: {src.count} bands, expected {bands[1]}")
        ranks.append((str(path), src, rank_window(src, scene, path)))
    return scene, ranks


def window_valid_mask(src: rasterio.io.DatasetReader, spec: ImageSpec, window: Window) -> np.ndarray | None:
    """Valid pixels of a window under the spec's mask (None: all valid); reads the mask alone where it is a band
    or GDAL's mask, the bands for a nodata value or float pixels."""
    floats = any(np.dtype(src.dtypes[band - 1]).kind == "f" for band in spec.bands)
    if spec.mask == "none" and not floats:
        return None
    with decoding(src.name, window):
        if spec.mask == "alpha" and not floats:
            return src.read(spec.alpha, window=window) > 0
        if spec.mask == "dataset" and not floats:
            return src.dataset_mask(window=window) > 0
    return read_masked(src, spec, window=window)[1]


def claimed_pieces(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]],
    window: Window,
    claims: Callable[[np.ndarray], np.ndarray],
    **read: Any,
) -> Iterator[tuple[rasterio.io.DatasetReader, Window, slice, slice, np.ndarray, np.ndarray]]:
    """Each rank raster's piece of a merge block ``window``: (its reader, the piece's window in it, the block's rows
    and columns it covers, its pixels read with ``read``, the pixels it claims by ``claims(pixels)``). A pixel two
    rank rasters claim raises ValueError naming both."""
    owner = np.full((int(window.height), int(window.width)), -1, dtype=np.int32)
    for index, (path, src, rank) in enumerate(ranks):
        common = intersection(window, rank)
        if common is None:
            continue
        inside = Window(common.col_off - rank.col_off, common.row_off - rank.row_off, common.width, common.height)
        rows = slice(common.row_off - window.row_off, common.row_off - window.row_off + common.height)
        cols = slice(common.col_off - window.col_off, common.col_off - window.col_off + common.width)
        data = src.read(window=inside, **read)
        claimed = claims(data)
        clash = claimed & (owner[rows, cols] >= 0)
        if clash.any():
            r, c = (int(v[0]) for v in np.nonzero(clash))
            other = ranks[owner[rows, cols][r, c]][0]
            raise ValueError(
                f"pixel (row {common.row_off + r}, col {common.col_off + c}) claimed by two rank rasters: "
                f"{other} and {path}"
            )
        np.copyto(owner[rows, cols], index, where=claimed)
        yield src, inside, rows, cols, data, claimed


def block_windows(width: int, height: int, block: int) -> list[Window]:
    return [
        Window(col, row, min(block, width - col), min(block, height - row))
        for row in range(0, height, block)
        for col in range(0, width, block)
    ]


# --- a layer's scratch raster, and its COG ----------------------------------------------------------------------


@dataclass(frozen=True)
class ScratchLayer:
    """A scene's merged layer being written: its scratch raster (``tmp``, open for writing as ``dst``: uncompressed,
    tiled in ``block`` px blocks as the COG is) and the COG ``output`` it becomes, whose overviews take
    ``resampling``."""

    output: Path
    tmp: Path
    dst: Any  # rasterio's dataset writer
    block: int
    resampling: Resampling

    def close(self) -> None:
        """Close the scratch raster: every pixel written (a full file system: a DiskFullError naming the output)."""
        self.dst.close()
        check_written(self.output)  # GDAL may lose a failed write at close without raising

    def finish(self, threads: int) -> None:
        """Make the closed scratch raster the COG (:func:`rasterscale.raster.cog.cog_of_scratch`), compressed on
        ``threads`` cores."""
        with writing(self.output):
            cog_of_scratch(self.tmp, self.output, self.block, self.resampling, threads)


def open_layer(
    stack: contextlib.ExitStack,
    output: Path,
    profile: Mapping[str, Any],
    resampling: Resampling,
    block: int = BLOCK_SIZE,
) -> ScratchLayer:
    """The scratch raster of the layer ``output`` (``profile``: its size, bands, dtype, georeferencing and nodata),
    open for writing in ``stack``, removed when ``stack`` closes (:func:`scratch_path`)."""
    tmp = stack.enter_context(scratch_path(output, "assembly"))
    dst = stack.enter_context(rasterio.open(tmp, "w", **scratch_profile(profile, block)))
    return ScratchLayer(output, tmp, dst, block, resampling)


def finish_layers(layers: Sequence[ScratchLayer], threads: int, meanwhile: Callable[[], T]) -> T:
    """Close the scratch rasters, make each its COG and run ``meanwhile`` (which may read the finished scratch
    rasters of ``layers[0]``); returns what it returns. With ``threads`` > 1 the later layers are made on their own
    threads while this one makes the first and then runs ``meanwhile`` (GDAL compresses without Python's lock);
    each COG is compressed on ``threads`` cores (GDAL's configuration set in this thread holds in theirs: rasterio
    sets the main thread's for the process)."""
    for layer in layers:
        layer.close()
    if threads <= 1 or len(layers) < 2:
        for layer in layers:
            layer.finish(threads)
        return meanwhile()
    with ThreadPoolExecutor(max_workers=len(layers) - 1, thread_name_prefix="cog") as pool:
        others = [pool.submit(layer.finish, threads) for layer in layers[1:]]
        layers[0].finish(threads)
        result = meanwhile()
        for other in others:
            other.result()  # a failure there (a full disk: its DiskFullError) is raised here
    return result


def write_project_mosaic(job: ProjectJobFields, layer: str, task: str) -> int:
    """A project's ``layer`` at ``job.outputs[layer]``: a VRT over the scenes' merged rasters of it, then the
    seams' (drawn over the scenes' where they predicted, their nodata left out); returns how many rasters it
    draws. The scenes must share a CRS (a VRT has one; ``task`` names the project's task in the error)."""
    crs = {source.crs for source in job.sources if source.crs is not None}
    if len(crs) > 1:
        raise InputError(f"project: the scenes are in {len(crs)} CRSs; a {task} project's VRT needs one")
    ordered = sorted(job.sources, key=lambda source: is_seam(source.name))
    write_mosaic(job.outputs[layer], [source.outputs[layer] for source in ordered])
    return len(ordered)
