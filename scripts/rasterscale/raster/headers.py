"""Raster headers: what a raster is (size, bands, data type, georeference, masks) and the checks that it can be
read, from its metadata only (never its pixels), each failing with one line that names the file. A remote raster
(a URL: :mod:`rasterscale.raster.remote`) is checked the same way from its header's bytes."""

from __future__ import annotations

import bisect
import functools
import itertools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import rasterio
from affine import Affine
from rasterio.crs import CRS
from rasterio.enums import ColorInterp, MaskFlags
from rasterio.errors import RasterioIOError

from rasterscale.errors import InputError
from rasterscale.raster.remote import is_remote, open_raster, remote_open_error, shown

DEFAULT_BANDS = (1, 2, 3)


@dataclass(frozen=True)
class RasterInfo:
    path: str
    width: int
    height: int
    count: int
    crs: CRS
    transform: Affine
    block_shapes: tuple[tuple[int, int], ...]
    dtypes: tuple[str, ...] = ()
    alpha: int | None = None  # one-based index of the alpha band
    nodata: float | None = None
    dataset_mask: bool = False  # a per-dataset mask (internal or .msk) marks invalid pixels

    @property
    def is_tiled(self) -> bool:
        """Internally tiled (square-ish blocks), not striped: windowed reads touch only nearby blocks."""
        return all(cols < self.width or self.width <= cols == rows for rows, cols in self.block_shapes)


def raster_info(src: rasterio.io.DatasetReader) -> RasterInfo:
    """The header facts of an open raster."""
    alphas = [k + 1 for k, interp in enumerate(src.colorinterp) if interp == ColorInterp.alpha]
    return RasterInfo(
        str(src.name),
        src.width,
        src.height,
        src.count,
        src.crs,
        src.transform,
        tuple(src.block_shapes),
        tuple(src.dtypes),
        alphas[0] if alphas else None,
        src.nodata,
        MaskFlags.per_dataset in src.mask_flag_enums[0],
    )


def read_raster_header(path: str | Path) -> RasterInfo:
    """A raster's header; one line naming the file (or URL) when it cannot be read."""
    try:
        with open_raster(path) as src:
            return replace(raster_info(src), path=str(path))  # as given (GDAL's name of a URL is /vsi...)
    except RasterioIOError as err:
        if is_remote(path):
            raise remote_open_error(path, err) from err
        raise InputError(f"{path}: not a readable raster ({err})") from err


ALL_BLOCKS_UP_TO = 16384  # blocks a band whose offsets are all read; beyond, only its last two block rows


def truncated_end(path: str | Path) -> tuple[int, int] | None:
    """(file size, where its blocks end) of a GeoTIFF cut short, from the offsets and sizes of its blocks in the
    header (GDAL's ``BLOCK_OFFSET_x_y``/``BLOCK_SIZE_x_y``, microseconds a block); None when every block lies in
    the file, or the raster is no GeoTIFF (a VRT's sources are GeoTIFFs checked on their own). Writers put blocks
    in row order, so a band of more than :data:`ALL_BLOCKS_UP_TO` blocks is judged on its last two block rows."""
    return _checked_header(str(path))[1]


def _checked_header(path: str) -> tuple[RasterInfo, tuple[int, int] | None]:
    """A raster's header and :func:`truncated_end`, from one open of it (cached per file version)."""
    stat = Path(path).stat()
    return _read_checked_header(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)  # once per raster and version in a process (the plan checks a scene twice)
def _read_checked_header(path: str, size: int, mtime_ns: int) -> tuple[RasterInfo, tuple[int, int] | None]:
    # A raster with no file beside it that GDAL would read (overviews, mask, .aux.xml, world file...) is opened
    # without GDAL listing its folder for them: half the cost of an open in a folder of 10,000 rasters.
    alone = {} if has_siblings(path) else {"GDAL_DISABLE_READDIR_ON_OPEN": "EMPTY_DIR"}
    try:
        with rasterio.Env(**alone), rasterio.open(path) as src:
            return raster_info(src), _blocks_end(src, size)
    except RasterioIOError as err:
        raise InputError(f"{path}: not a readable raster ({err})") from err


def has_siblings(path: str | Path) -> bool:
    """Whether a local raster's folder holds another entry whose name starts with the raster's stem, compared
    without case: GDAL's sidecar files (``x.tif.ovr``, ``x.tif.msk``, ``x.tif.aux.xml``, ``x.tfw``, ``x.IMD``,
    ``x_rpc.txt``...) all do."""
    path = Path(path)
    folder = path.parent
    names = _folder_names(str(folder), folder.stat().st_mtime_ns)
    stem, own = path.stem.casefold(), path.name.casefold()
    start = bisect.bisect_left(names, stem)
    for name in itertools.islice(names, start, None):
        if not name.startswith(stem):
            return False
        if name != own:
            return True
    return False


@functools.lru_cache(maxsize=64)
def _folder_names(folder: str, mtime_ns: int) -> list[str]:
    """A folder's entries, case-folded and sorted (once per folder and version: a new file changes its mtime)."""
    return sorted(name.casefold() for name in os.listdir(folder))


def _blocks_end(src: rasterio.io.DatasetReader, size: int) -> tuple[int, int] | None:
    if src.driver != "GTiff":
        return None
    rows, cols = src.block_shapes[0]
    block_rows, block_cols = -(-src.height // rows), -(-src.width // cols)
    first_row = 0 if block_rows * block_cols <= ALL_BLOCKS_UP_TO else max(0, block_rows - 2)
    bands = range(1, src.count + 1) if src.interleaving and src.interleaving.name == "band" else [1]
    end = 0
    for band in bands:
        for y in range(first_row, block_rows):
            for x in range(block_cols):
                offset = src.get_tag_item(f"BLOCK_OFFSET_{x}_{y}", "TIFF", bidx=band)
                nbytes = src.get_tag_item(f"BLOCK_SIZE_{x}_{y}", "TIFF", bidx=band)
                if offset and nbytes:
                    end = max(end, int(offset) + int(nbytes))
    return (size, end) if end > size else None


def check_raster(path: str | Path) -> RasterInfo:
    """Open a raster's header and check it can feed an RGB model in a georeferenced way, and that a local GeoTIFF
    holds all of its blocks (a remote one's size is the server's to know: it is not fetched for this)."""
    path = str(path)
    remote = is_remote(path)
    if not remote and not Path(path).exists():
        raise InputError(f"{path}: raster not found")
    info, cut = _checked_header(path) if not remote else (read_raster_header(path), None)
    if cut is not None:
        raise InputError(
            f"{path}: GeoTIFF is truncated: the file has {cut[0]} bytes but its blocks reach byte {cut[1]} "
            "(an interrupted copy or download?); copy it again"
        )
    if info.crs is None:
        raise InputError(
            f"{shown(path)}: raster has no CRS; outputs could not be placed on the map (set one with gdal_edit.py "
            "-a_srs)"
        )
    if info.transform == Affine.identity():
        raise InputError(f"{shown(path)}: raster has no geotransform (pixel coordinates only)")
    return info
