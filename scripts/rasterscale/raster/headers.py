"""Raster headers: what a raster is (size, bands, data type, georeference, masks) and the checks that it can be
read, from its metadata only (never its pixels), each failing with one line that names the file. A remote raster
(a URL: :mod:`rasterscale.raster.remote`) is checked the same way from its header's bytes.

While the workflow's plan is built, :func:`checked_header` answers from the plan's header reads
(:mod:`rasterscale.raster.header_cache`: read ahead by a thread pool, kept across invocations) through
:func:`headers_from`; elsewhere it reads the header itself."""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
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
    driver: str = ""  # GDAL's driver (GTiff, VRT, ...)

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
        src.driver,
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


# A raster's header and where a GeoTIFF's blocks reach past its end (:func:`truncated_end`): what :func:`check_raster`
# judges, and what the header cache keeps.
CheckedHeader = tuple[RasterInfo, tuple[int, int] | None]
# Where this thread's checks get their headers while a plan is built (:func:`headers_from`); None: read here.
_SOURCE: ContextVar[Callable[[str], CheckedHeader] | None] = ContextVar("header_source", default=None)


@contextlib.contextmanager
def headers_from(source: Callable[[str], CheckedHeader]) -> Iterator[None]:
    """Within the block, this thread's :func:`checked_header` (and so :func:`check_raster`) asks ``source`` (the
    plan's header reads); other threads, the source's own among them, read headers themselves."""
    token = _SOURCE.set(source)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def checked_header(path: str) -> CheckedHeader:
    """A raster's header and :func:`truncated_end`: from the source of :func:`headers_from` when one is set in this
    thread, else :func:`read_checked_header`."""
    source = _SOURCE.get()
    return source(path) if source is not None else read_checked_header(path)


def read_checked_header(path: str) -> CheckedHeader:
    """A raster's header and :func:`truncated_end`, from one open of it: a local one once per file version in a
    process; a remote one's end is not checked (its size is the server's to know)."""
    if is_remote(path):
        return read_raster_header(path), None
    stat = Path(path).stat()
    return _read_checked_header(path, stat.st_size, stat.st_mtime_ns)


def truncated_end(path: str | Path) -> tuple[int, int] | None:
    """(file size, where its blocks end) of a GeoTIFF cut short, from the offsets and sizes of its blocks in the
    header (GDAL's ``BLOCK_OFFSET_x_y``/``BLOCK_SIZE_x_y``, microseconds a block); None when every block lies in
    the file, or the raster is no GeoTIFF (a VRT's sources are GeoTIFFs checked on their own). Writers put blocks
    in row order, so a band of more than :data:`ALL_BLOCKS_UP_TO` blocks is judged on its last two block rows."""
    return checked_header(str(path))[1]


@functools.lru_cache(maxsize=4096)  # once per raster and version in a process (the plan checks a scene twice)
def _read_checked_header(path: str, size: int, mtime_ns: int) -> CheckedHeader:
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
    return bool(siblings(path))


def siblings(path: str | Path) -> list[str]:
    """The entries of a local raster's folder (their names) that start with the raster's stem, compared without
    case, the raster's own left out: every sidecar file GDAL may read with it, and maybe others."""
    path = Path(path)
    folder = path.parent
    folded, names = _folder_names(str(folder), folder.stat().st_mtime_ns)
    stem, own = path.stem.casefold(), path.name.casefold()
    found = []
    for index in range(bisect.bisect_left(folded, stem), len(folded)):
        if not folded[index].startswith(stem):
            break
        if folded[index] != own:
            found.append(names[index])
    return found


@functools.lru_cache(maxsize=64)
def _folder_names(folder: str, mtime_ns: int) -> tuple[list[str], list[str]]:
    """A folder's entries, case-folded and sorted, and their names in that order (once per folder and version: a
    new file changes its mtime)."""
    pairs = sorted((name.casefold(), name) for name in os.listdir(folder))
    return [folded for folded, _ in pairs], [name for _, name in pairs]


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


PYTHON_PIXEL_FUNCTION = re.compile(rb"<PixelFunctionLanguage>\s*Python\s*<", re.IGNORECASE)


def refuse_vrt_code(path: str) -> None:
    """A VRT whose pixel function is Python code is refused at the dry run (GDAL would not run it anyway: every
    rasterscale process sets ``GDAL_VRT_ENABLE_PYTHON=NO``, :mod:`rasterscale.raster`)."""
    if path.lower().endswith(".vrt") and PYTHON_PIXEL_FUNCTION.search(Path(path).read_bytes()):
        raise InputError(f"{path}: a VRT with a Python pixel function: rasterscale runs no code from a file")


def check_raster(path: str | Path) -> RasterInfo:
    """Open a raster's header and check it can feed an RGB model in a georeferenced way, and that a local GeoTIFF
    holds all of its blocks (a remote one's size is the server's to know: it is not fetched for this)."""
    path = str(path)
    remote = is_remote(path)
    if not remote and not Path(path).exists():
        raise InputError(f"{path}: raster not found")
    if not remote:
        refuse_vrt_code(path)
    info, cut = checked_header(path)
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
