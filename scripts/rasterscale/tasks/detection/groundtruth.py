"""Detection's ground truth (``scenes.X.annotations``): a scene's boxes in its raster's pixels with their classes,
each file checked with one line that names it.

These checks run at workflow load (``snakemake -n``) for inputs that already exist, and again inside the rules.
They read metadata only, never pixels: a GeoTIFF cut short is found from its header (its blocks' offsets and
sizes reach past the end of the file). What only decoding finds (a block whose bytes are damaged) fails the
job reading it with :class:`RasterReadError` (``imagery.decoding``), one line naming the raster and the window or
tile: a rank's in the rule's log with its traceback in the rank's own (``runtime``), a one-process job's (COG
conversion, tile manifest, merge, evaluation) alone (:func:`run_entry`).

Annotations come as any OGR vector file (polygons in a CRS: boxes, or outlines whose bounds are the boxes;
an empty geometry, a point or a line fails), a DeepForest CSV (``image_path,xmin,ymin,xmax,ymax,
label`` in the raster's pixels) or Pascal VOC XML (``<filename>``, ``<object><name>`` and ``<bndbox>``, pixels).
A CSV or XML names its image: only the rows of the scene's raster (its file name, or ``scenes.X.image_path``)
are used, the others are counted in the log.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np

from rasterscale.errors import InputError
from rasterscale.raster.geo import geometries_to_pixel_boxes
from rasterscale.raster.geometry_checks import check_polygonal, read_features
from rasterscale.raster.headers import RasterInfo
from rasterscale.tasks.labels import label_indexes

CSV_COLUMNS = ["image_path", "xmin", "ymin", "xmax", "ymax", "label"]
BOX_KEYS = ("xmin", "ymin", "xmax", "ymax")
BOXES = "detection boxes come as polygons in a vector file (boxes or outlines), a DeepForest CSV or a Pascal VOC file"
LOGGER = logging.getLogger(__name__)


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
        rows = reader(path)
        mine = np.array([PurePath(name.replace("\\", "/")).name == image for name in rows.images])
        ignored = int((~mine).sum())
        if not mine.any():
            images = ", ".join(sorted(set(rows.images))[:5])
            raise InputError(f"{path}: no box for image {image} (it has boxes of {images}; set scenes.X.image_path)")
        if ignored:
            LOGGER.warning("%s: %d box(es) of other images than %s ignored", path, ignored, image)
        boxes = rows.boxes[mine]
        label_ids = label_indexes(path, np.array(rows.labels, dtype=object)[mine].astype(str), labels)
    else:
        boxes, label_ids = read_vector_boxes(path, raster, labels, label_column)
        ignored = 0
    inside = (boxes[:, 2] > 0) & (boxes[:, 3] > 0) & (boxes[:, 0] < raster.width) & (boxes[:, 1] < raster.height)
    if not inside.any():
        raise InputError(f"{path}: no annotation overlaps the raster {raster.path}")
    return Annotations(boxes[inside], label_ids[inside], ignored)


def read_vector_boxes(
    path: str, raster: RasterInfo, labels: list[str], label_column: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (pixels of the raster) and label indexes of an OGR vector file or GeoParquet: each feature a polygon
    (its bounds are the box); an empty geometry, a point (a tree top) or a line fails with one line naming it."""
    frame, names = read_features(path, BOXES)
    if len(frame) == 0:
        raise InputError(f"{path}: annotation file holds no boxes")
    check_polygonal(path, frame.geometry.to_numpy(), names, "detection boxes need polygons (a box or an outline)")
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
    boxes = geometries_to_pixel_boxes(frame.geometry.to_numpy(), raster.transform)
    flat = (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])
    if flat.any():
        first = int(np.flatnonzero(flat)[0])
        raise InputError(f"{path}: {names[first]} is a polygon of no width or height; detection boxes need an area")
    return boxes, label_ids


@dataclass(frozen=True)
class PixelRows:
    """The boxes of a DeepForest CSV or VOC file: each row's image name, box (pixels) and class name."""

    images: list[str]
    boxes: np.ndarray  # (N, 4) float64 xmin, ymin, xmax, ymax
    labels: list[str]


def read_deepforest_csv(path: str) -> PixelRows:
    """A DeepForest CSV's rows (image_path, xmin, ymin, xmax, ymax, label; pixel coordinates), checked. Read with
    the csv module, not pandas: the plan checks every scene's file, thousands of small files at a parse."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames
            if not columns:
                raise InputError(f"{path}: annotation file holds no boxes")
            missing = [c for c in CSV_COLUMNS if c not in columns]
            if missing:
                raise InputError(
                    f"{path}: DeepForest CSV lacks column(s) {', '.join(missing)} (needs {','.join(CSV_COLUMNS)})"
                )
            rows = [(reader.line_num, row) for row in reader]
            extra = next((line for line, row in rows if None in row), None)  # DictReader's key of surplus fields
            if extra is not None:
                raise InputError(f"{path}: line {extra} has more fields than the header (a comma inside a value?)")
    except (csv.Error, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a readable CSV ({str(err).splitlines()[0]})") from err
    if not rows:
        raise InputError(f"{path}: annotation file holds no boxes")
    boxes = [[row.get(key) or "" for key in BOX_KEYS] for _, row in rows]
    return PixelRows(
        images=[str(row.get("image_path") or "") for _, row in rows],
        boxes=check_pixel_boxes(path, boxes, [line for line, _ in rows]),
        labels=[str(row.get("label") or "") for _, row in rows],
    )


def read_voc_xml(path: str) -> PixelRows:
    """A Pascal VOC file's boxes (its ``<filename>`` is every box's image name)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise InputError(f"{path}: not a readable XML file ({err})") from err
    filename = root.findtext("filename")
    if root.tag != "annotation" or not filename:
        raise InputError(f"{path}: not a Pascal VOC file (needs <annotation> with <filename>)")
    boxes, labels = [], []
    for number, obj in enumerate(root.iter("object"), start=1):
        box = obj.find("bndbox")
        name = obj.findtext("name")
        if box is None or not name:
            raise InputError(f"{path}: <object> {number} lacks <name> or <bndbox>")
        boxes.append([box.findtext(key) or "" for key in BOX_KEYS])
        labels.append(name.strip())
    if not boxes:
        raise InputError(f"{path}: annotation file holds no boxes")
    checked = check_pixel_boxes(path, boxes, list(range(1, len(boxes) + 1)), row_name="<object>")
    return PixelRows(images=[filename] * len(boxes), boxes=checked, labels=labels)


def check_pixel_boxes(path: str, boxes: list[list[str]], rows: list[int], row_name: str = "line") -> np.ndarray:
    """Pixel boxes must be numbers with xmin < xmax and ymin < ymax; the first bad row (numbered by ``rows``)
    fails with one line. The boxes as an (N, 4) float64 array."""
    values = np.full((len(boxes), 4), np.nan)
    for index, box in enumerate(boxes):
        for column, text in enumerate(box):
            with contextlib.suppress(TypeError, ValueError):  # not a number: NaN, a bad box
                values[index, column] = float(text)
    bad = np.isnan(values).any(axis=1) | (values[:, 2] <= values[:, 0]) | (values[:, 3] <= values[:, 1])
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        shown = ", ".join(str(v).strip() if str(v).strip() else "nan" for v in boxes[first])
        raise InputError(
            f"{path}: {row_name} {rows[first]} has a bad box ({shown}); needs numbers, xmin < xmax, ymin < ymax"
        )
    return values
