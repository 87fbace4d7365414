"""Checks of user inputs (rasters and annotations), each failing with one line that names the file.

These run at workflow load (``snakemake -n``) for inputs that already exist, and again inside the rules.
They read metadata only, never pixels: a GeoTIFF cut short is found from its header (its blocks' offsets and
sizes reach past the end of the file). What only decoding finds (a block whose bytes are damaged) fails the
job reading it with :class:`RasterReadError` (``imagery.decoding``), one line naming the raster and the window or
tile: a rank's in the rule's log with its traceback in the rank's own (``runtime``), a one-process job's (COG
conversion, tile manifest, merge, evaluation) alone (:func:`run_entry`).

Annotations come as any OGR vector file (boxes in a CRS), a DeepForest CSV (``image_path,xmin,ymin,xmax,ymax,
label`` in the raster's pixels) or Pascal VOC XML (``<filename>``, ``<object><name>`` and ``<bndbox>``, pixels).
A CSV or XML names its image: only the rows of the scene's raster (its file name, or ``scenes.X.image_path``)
are used, the others are counted in the log.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd
import rasterio
from affine import Affine
from rasterio.crs import CRS
from rasterio.enums import ColorInterp, MaskFlags
from rasterio.errors import RasterioIOError

from rasterscale.raster.geo import geometries_to_pixel_boxes

RGB_BANDS = 3
DEFAULT_BANDS = (1, 2, 3)
CSV_COLUMNS = ["image_path", "xmin", "ymin", "xmax", "ymax", "label"]
LOGGER = logging.getLogger(__name__)


class InputError(ValueError):
    """A problem with an input file, worded as one line that names the file."""


class RasterReadError(InputError):
    """Pixels of a raster that will not decode where they are read (run time: its header was fine)."""


def one_line(error: BaseException) -> str:
    """An input error's one line, also when a dataloader worker raised it: PyTorch re-raises a worker's exception
    in the rank with the worker's traceback as its message, the original line last."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return lines[-1].split("Error: ", 1)[-1]
    return lines[0] if lines else type(error).__name__


def run_entry(main: Callable[[], None]) -> None:
    """Run a one-process job's entry: an input error (the user's to fix: a damaged block of a raster, a bad class
    id) ends it with exit 1 and its one line, ``rasterscale: ...``, in the rule's log, not a traceback. (A rank
    logs it so too, with its traceback in the rank's own log: ``runtime``.)"""
    try:
        main()
    except InputError as err:
        sys.stderr.write(f"rasterscale: {one_line(err)}\n")
        sys.exit(1)


def innermost_cause(error: BaseException) -> str:
    """The first line of the deepest exception in ``error``'s cause chain (GDAL's own words)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).splitlines()[0] if str(error) else type(error).__name__


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
    """A raster's header; one line naming the file when it cannot be read."""
    try:
        with rasterio.open(path) as src:
            return raster_info(src)
    except RasterioIOError as err:
        raise InputError(f"{path}: not a readable raster ({err})") from err


ALL_BLOCKS_UP_TO = 16384  # blocks a band whose offsets are all read; beyond, only its last two block rows


def truncated_end(path: str | Path) -> tuple[int, int] | None:
    """(file size, where its blocks end) of a GeoTIFF cut short, from the offsets and sizes of its blocks in the
    header (GDAL's ``BLOCK_OFFSET_x_y``/``BLOCK_SIZE_x_y``, microseconds a block); None when every block lies in
    the file, or the raster is no GeoTIFF (a VRT's sources are GeoTIFFs checked on their own). Writers put blocks
    in row order, so a band of more than :data:`ALL_BLOCKS_UP_TO` blocks is judged on its last two block rows."""
    path = Path(path)
    stat = path.stat()
    return _truncated_end(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)  # once per raster and version in a process (the dry run checks a scene twice)
def _truncated_end(path: str, size: int, mtime_ns: int) -> tuple[int, int] | None:
    with rasterio.open(path) as src:
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
    """Open a raster's header and check it can feed an RGB model in a georeferenced way, and that a GeoTIFF
    holds all of its blocks."""
    path = str(path)
    if not Path(path).exists():
        raise InputError(f"{path}: raster not found")
    info = read_raster_header(path)
    cut = truncated_end(path)
    if cut is not None:
        raise InputError(
            f"{path}: GeoTIFF is truncated: the file has {cut[0]} bytes but its blocks reach byte {cut[1]} "
            "(an interrupted copy or download?); copy it again"
        )
    if info.crs is None:
        raise InputError(
            f"{path}: raster has no CRS; outputs could not be placed on the map (set one with gdal_edit.py -a_srs)"
        )
    if info.transform == Affine.identity():
        raise InputError(f"{path}: raster has no geotransform (pixel coordinates only)")
    return info


def check_imagery(raster: RasterInfo, bands: Sequence[int] | None, scale: Mapping[str, Any] | None, key: str) -> None:
    """Check that a scene's ``bands`` and ``scale`` (config ``<key>.bands``/``<key>.scale``, e.g. key
    ``scenes.ortho``) can make uint8 RGB tiles of the raster: one line naming the file and the key otherwise."""
    path = raster.path
    given = bands
    bands = list(bands or DEFAULT_BANDS)
    if len(bands) != RGB_BANDS:
        raise InputError(f"{path}: {key}.bands lists {len(bands)} band(s); the model needs {RGB_BANDS} (RGB)")
    outside = [b for b in bands if not 1 <= b <= raster.count]
    if outside:
        raise InputError(
            f"{path}: raster has {raster.count} band(s); {key}.bands {bands} asks for band(s) "
            f"{', '.join(map(str, outside))} (set {key}.bands to 3 of 1..{raster.count})"
        )
    if raster.alpha is not None and raster.alpha in bands:
        raise InputError(f"{path}: band {raster.alpha} is the alpha band (the mask); leave it out of {key}.bands")
    check_scale(raster, bands, scale, key)
    colours = raster.count - (raster.alpha is not None)
    if given is None and not scale and colours > RGB_BANDS:  # uint8 RGBN, or RGBA whose alpha is not marked so
        raise InputError(
            f"{path}: raster has {colours} bands{' besides its alpha band' if raster.alpha else ''}; set "
            f"{key}.bands to the three (1-based) the model sees as red, green, blue (e.g. [1, 2, 3])"
        )


def check_scale(raster: RasterInfo, bands: list[int], scale: Mapping[str, Any] | None, key: str) -> None:
    """Bands that are not uint8 need ``<key>.scale``, and a scale must be well formed."""
    path = raster.path
    dtypes = sorted({raster.dtypes[b - 1] for b in bands}) if raster.dtypes else ["uint8"]
    if not scale:
        if dtypes != ["uint8"]:
            raise InputError(
                f"{path}: bands are {'/'.join(dtypes)}, not uint8; set {key}.scale ({{min: [..], max: [..]}} per "
                "band, or {percentile: [2, 98]}) to map them to 0-255"
            )
        return
    if "percentile" in scale:
        low, high = scale["percentile"]
        if not 0 <= low < high <= 100:
            raise InputError(f"{path}: {key}.scale.percentile [{low}, {high}] must be 0 <= low < high <= 100")
        return
    limits = {}
    for name in ("min", "max"):
        value = scale.get(name)
        if value is None:
            raise InputError(f"{path}: {key}.scale needs both min and max (or percentile)")
        values = [value] * len(bands) if isinstance(value, int | float) else list(value)
        if len(values) != len(bands):
            raise InputError(
                f"{path}: {key}.scale.{name} has {len(values)} value(s) for the {len(bands)} bands of {key}.bands"
            )
        limits[name] = values
    wrong = [k for k, (lo, hi) in enumerate(zip(limits["min"], limits["max"], strict=True)) if not lo < hi]
    if wrong:
        raise InputError(f"{path}: {key}.scale.min must be below {key}.scale.max (band {bands[wrong[0]]})")


WORKFLOW_FOLDERS = ("results", "results/models", "logs", "benchmarks", ".snakemake")


def unwritable_folder(workdir: str | Path = ".", others: Sequence[str | Path] = ()) -> Path | None:
    """The first folder the workflow writes into that it cannot (the working directory, its results/, logs/,
    benchmarks/, .snakemake/ and ``others`` where they exist), or None."""
    workdir = Path(workdir)
    for folder in [workdir, *(workdir / name for name in WORKFLOW_FOLDERS), *map(Path, others)]:
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return folder
    return None


@dataclass(frozen=True)
class Annotations:
    boxes: np.ndarray  # (N, 4) pixel boxes in the raster
    labels: np.ndarray  # (N,) int64 label indices (0-based into the label list)
    ignored: int = 0  # rows of a CSV/VOC file that name another image


def read_annotations(
    path: str | Path,
    raster: RasterInfo,
    labels: list[str],
    label_column: str | None = None,
    image_path: str | None = None,
) -> Annotations:
    """Ground-truth boxes of a scene in the raster's pixel space; bad files fail with one line.

    ``.csv`` is read as DeepForest CSV and ``.xml`` as Pascal VOC, keeping the rows whose image is
    ``image_path`` (compared by file name; default: the raster's file name); anything else as an OGR vector
    file (``label_column`` names its class column). Class names map through ``labels``.
    """
    path = str(path)
    if not Path(path).exists():
        raise InputError(f"{path}: annotation file not found")
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".xml"):
        image = PurePath(image_path or raster.path).name
        reader = read_deepforest_csv if suffix == ".csv" else read_voc_xml
        frame = reader(path)
        mine = frame["image_path"].map(lambda p: PurePath(str(p).replace("\\", "/")).name) == image
        ignored = int((~mine).sum())
        if not mine.any():
            images = ", ".join(sorted(frame["image_path"].astype(str).unique())[:5])
            raise InputError(f"{path}: no box for image {image} (it has boxes of {images}; set scenes.X.image_path)")
        if ignored:
            LOGGER.warning("%s: %d box(es) of other images than %s ignored", path, ignored, image)
        frame = frame[mine]
        boxes = frame[["xmin", "ymin", "xmax", "ymax"]].to_numpy(dtype=np.float64)
        label_ids = label_indexes(path, frame["label"].astype(str).to_numpy(), labels)
    else:
        boxes, label_ids = read_vector_boxes(path, raster, labels, label_column)
        ignored = 0
    inside = (boxes[:, 2] > 0) & (boxes[:, 3] > 0) & (boxes[:, 0] < raster.width) & (boxes[:, 1] < raster.height)
    if not inside.any():
        raise InputError(f"{path}: no annotation overlaps the raster {raster.path}")
    return Annotations(boxes[inside], label_ids[inside], ignored)


def label_indexes(path: str, names: np.ndarray, labels: list[str]) -> np.ndarray:
    """Class names -> 0-based indexes into ``labels``; an unknown name fails with one line."""
    unknown = sorted(set(names) - set(labels))
    if unknown:
        raise InputError(f"{path}: label(s) {', '.join(unknown)} are not in model.labels ({', '.join(labels)})")
    index = {name: k for k, name in enumerate(labels)}
    return np.array([index[name] for name in names], dtype=np.int64)


def read_vector_boxes(
    path: str, raster: RasterInfo, labels: list[str], label_column: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (pixels of the raster) and label indexes of an OGR vector file or GeoParquet."""
    try:
        frame = gpd.read_parquet(path) if path.endswith(".parquet") else gpd.read_file(path)
    except Exception as err:  # pyogrio and pyarrow raise many types
        raise InputError(f"{path}: not a readable vector file ({err})") from err
    frame = frame[~(frame.geometry.isna() | frame.geometry.is_empty)]
    if len(frame) == 0:
        raise InputError(f"{path}: annotation file holds no boxes")
    if frame.crs is None:
        raise InputError(f"{path}: annotations have no CRS")
    if frame.crs != raster.crs:
        frame = frame.to_crs(raster.crs)
    if label_column:
        if label_column not in frame.columns:
            raise InputError(f"{path}: no column '{label_column}' (columns: {', '.join(map(str, frame.columns))})")
        label_ids = label_indexes(path, frame[label_column].astype(str).to_numpy(), labels)
    else:
        label_ids = np.zeros(len(frame), dtype=np.int64)
    return geometries_to_pixel_boxes(frame.geometry.to_numpy(), raster.transform), label_ids


def read_deepforest_csv(path: str) -> pd.DataFrame:
    """A DeepForest CSV's rows (image_path, xmin, ymin, xmax, ymax, label; pixel coordinates), checked."""
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise InputError(f"{path}: annotation file holds no boxes") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a readable CSV ({str(err).splitlines()[0]})") from err
    missing = [c for c in CSV_COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(f"{path}: DeepForest CSV lacks column(s) {', '.join(missing)} (needs {','.join(CSV_COLUMNS)})")
    if len(frame) == 0:
        raise InputError(f"{path}: annotation file holds no boxes")
    return check_pixel_boxes(path, frame, row_offset=2)


def read_voc_xml(path: str) -> pd.DataFrame:
    """A Pascal VOC file's boxes as DeepForest CSV rows (its ``<filename>`` is every row's image_path)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise InputError(f"{path}: not a readable XML file ({err})") from err
    filename = root.findtext("filename")
    if root.tag != "annotation" or not filename:
        raise InputError(f"{path}: not a Pascal VOC file (needs <annotation> with <filename>)")
    rows = []
    for number, obj in enumerate(root.iter("object"), start=1):
        box = obj.find("bndbox")
        name = obj.findtext("name")
        if box is None or not name:
            raise InputError(f"{path}: <object> {number} lacks <name> or <bndbox>")
        try:
            coords = [float(box.findtext(k) or "nan") for k in ("xmin", "ymin", "xmax", "ymax")]
        except ValueError as err:
            raise InputError(f"{path}: <object> {number} has a bad <bndbox> ({err})") from err
        rows.append([filename, *coords, name.strip()])
    if not rows:
        raise InputError(f"{path}: annotation file holds no boxes")
    return check_pixel_boxes(path, pd.DataFrame(rows, columns=CSV_COLUMNS), row_offset=1, row_name="<object>")


def check_pixel_boxes(path: str, frame: pd.DataFrame, row_offset: int, row_name: str = "line") -> pd.DataFrame:
    """Pixel boxes must be numbers with xmin < xmax and ymin < ymax; the first bad row fails with one line."""
    coords = frame[["xmin", "ymin", "xmax", "ymax"]].apply(pd.to_numeric, errors="coerce")
    bad = coords.isna().any(axis=1) | (coords["xmax"] <= coords["xmin"]) | (coords["ymax"] <= coords["ymin"])
    if bad.any():
        first = int(np.flatnonzero(bad.to_numpy())[0])
        values = ", ".join(str(v) for v in frame.iloc[first][["xmin", "ymin", "xmax", "ymax"]])
        raise InputError(
            f"{path}: {row_name} {first + row_offset} has a bad box ({values}); needs numbers, xmin < xmax, ymin < ymax"
        )
    return frame.assign(**{c: coords[c] for c in coords.columns})
