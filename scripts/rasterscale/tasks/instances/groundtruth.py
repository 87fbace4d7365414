"""Crown polygons' ground truth: a scene's crowns as polygons in its raster's pixels, each with its class.

Ground truth comes as

* any OGR vector file or GeoParquet of polygons in any CRS, reprojected to the raster's CRS and then into its
  pixels (x = column, y = row) through its transform; a polygon's class is its ``label_column`` (class names
  among the labels), without one every polygon is class 0; or
* a COCO instances file (``.json``): of its ``images``, the one whose ``file_name`` is the raster's file name (or
  ``image_name``; compared by base name) and its size; its ``annotations``' ``segmentation`` as polygons (flat
  ``x, y`` lists in the image's pixels, 0,0 the top-left corner of the top-left pixel; several rings are parts of
  one crown) or run-length masks (``counts`` a list, or COCO's compressed string; column-major), and their
  ``categories``' names as classes. Annotations of other images are counted (``ignored``); crowd annotations
  (``iscrowd: 1``, a group of objects) are left out with a line in the log, as torchvision's COCO reference does.

Each crown must be one polygon: an empty geometry, a point or a line, a multipolygon of several parts, an invalid
polygon that does not mend into one (:mod:`rasterscale.raster.geometry_checks`), a polygon wholly outside the
raster, a missing label column or an unknown class fails with one line naming the file and the feature (OGR
feature id, GeoParquet row, COCO annotation id). Polygons partly outside the raster are clipped to its frame.

Torch-free: :func:`check_ground_truth` runs at plan time (``snakemake -n``), :func:`read_ground_truth` in the
training and evaluation jobs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import shapely
from affine import Affine
from rasterio.features import shapes

from rasterscale.errors import InputError
from rasterscale.raster.geometry_checks import (
    check_polygonal,
    clip_to_frame,
    mend_polygons,
    read_features,
    single_polygons,
)
from rasterscale.raster.headers import RasterInfo
from rasterscale.tasks.labels import label_indexes

LOGGER = logging.getLogger(__name__)
COCO_SUFFIX = ".json"
NEEDS = "crowns need polygons (a crown's outline)"
OUTLINES = (
    "crowns need outlines: a COCO JSON file (polygons or masks) or polygons in a vector file (GeoPackage, GeoJSON, "
    "Shapefile, GeoParquet)"
)
SHOWN_NAMES = 5  # image names a COCO error lists


@dataclass(frozen=True)
class GroundTruth:
    """A scene's crowns: polygons in its raster's pixels (x = column, y = row; a crown that the raster's edge cuts
    into pieces is a MultiPolygon) and their classes."""

    polygons: np.ndarray  # (N,) shapely polygons, pixel coordinates of the scene's raster (float)
    labels: np.ndarray  # (N,) int64 indexes into the label list
    ignored: int = 0  # annotations of other images in a COCO file


def read_ground_truth(
    path: str | Path,
    raster: RasterInfo,
    labels: list[str],
    label_column: str | None = None,
    image_name: str | None = None,
) -> GroundTruth:
    """A scene's crown polygons in its raster's pixels, checked (module docstring); one line naming the file and
    the feature when they do not fit. ``image_name``: a COCO file's image (default: the raster's file name)."""
    path = str(path)
    if not Path(path).exists():
        raise InputError(f"{path}: instance ground truth not found")
    if Path(path).suffix.lower() == COCO_SUFFIX:
        polygons, label_ids, names, ignored = read_coco(path, raster, labels, image_name)
    else:
        polygons, label_ids, names = read_vector_polygons(path, raster, labels, label_column)
        ignored = 0
    polygons = single_polygons(path, mend_polygons(path, polygons, names), names, "crown")
    polygons, outside = clip_to_frame(polygons, raster.width, raster.height)
    if outside.any():
        first = int(np.flatnonzero(outside)[0])
        raise InputError(
            f"{path}: {int(outside.sum())} of {len(polygons)} polygon(s) lie outside the raster {raster.path} "
            f"(the first: {names[first]}); another place, or a wrong CRS?"
        )
    return GroundTruth(polygons, label_ids, ignored)


def check_ground_truth(
    path: str | Path, raster: RasterInfo, labels: list[str], label_column: str | None, image_name: str | None
) -> GroundTruth:
    """The dry run's check of a scene's ground truth: all of :func:`read_ground_truth`'s (a few thousand polygons
    read and checked in tens of milliseconds); the ground truth."""
    return read_ground_truth(path, raster, labels, label_column, image_name)


# --- OGR vector files, GeoParquet -------------------------------------------------------------------------------


def read_vector_polygons(
    path: str, raster: RasterInfo, labels: list[str], label_column: str | None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Polygons (pixels of the raster), label indexes and feature names of an OGR vector file or GeoParquet."""
    frame, names = read_features(path, OUTLINES)
    if len(frame) == 0:
        raise InputError(f"{path}: ground truth holds no polygons")
    if label_column and label_column not in frame.columns:
        raise InputError(f"{path}: no column '{label_column}' (columns: {', '.join(map(str, frame.columns))})")
    check_polygonal(path, frame.geometry.to_numpy(), names, NEEDS)
    if frame.crs is None:
        raise InputError(f"{path}: ground-truth polygons have no CRS")
    if frame.crs != raster.crs:
        frame = frame.to_crs(raster.crs)
    if label_column:
        label_ids = label_indexes(path, frame[label_column].astype(str).to_numpy(), labels)
    else:
        label_ids = np.zeros(len(frame), dtype=np.int64)
    return to_pixels(frame.geometry.to_numpy(), raster.transform), label_ids, names


def to_pixels(geometries: np.ndarray, transform: Affine) -> np.ndarray:
    """Geometries in the raster's CRS as geometries in its pixels (column, row), through the inverse transform."""
    inverse = ~transform

    def apply(coords: np.ndarray) -> np.ndarray:
        x, y = coords[:, 0], coords[:, 1]
        return np.stack([inverse.a * x + inverse.b * y + inverse.c, inverse.d * x + inverse.e * y + inverse.f], 1)

    return np.asarray(shapely.transform(geometries, apply), dtype=object)


# --- COCO instances ---------------------------------------------------------------------------------------------


def read_coco(
    path: str, raster: RasterInfo, labels: list[str], image_name: str | None
) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """Polygons (pixels), label indexes, annotation names and the count of other images' annotations of the
    raster's image in a COCO instances file."""
    images, annotations, categories = coco_lists(path)
    image = coco_image(path, images, PurePath(image_name or raster.path).name)
    height, width = coco_image_size(path, image, raster)
    mine = [a for a in annotations if isinstance(a, dict) and a.get("image_id") == image.get("id")]
    ignored = len(annotations) - len(mine)
    crowds = [a for a in mine if a.get("iscrowd")]
    if crowds:
        LOGGER.warning("%s: %d crowd annotation(s) (iscrowd) of %s left out", path, len(crowds), image["file_name"])
    mine = [a for a in mine if not a.get("iscrowd")]
    if not mine:
        raise InputError(f"{path}: no annotation of image {image['file_name']} (id {image.get('id')}) to train on")
    if ignored:
        LOGGER.info("%s: %d annotation(s) of other images than %s ignored", path, ignored, image["file_name"])
    names = [f"annotation {a.get('id', f'#{k}')}" for k, a in enumerate(mine)]
    classes = coco_category_names(path, categories, mine, names)
    geometries = np.empty(len(mine), dtype=object)
    for k, (annotation, name) in enumerate(zip(mine, names, strict=True)):
        geometries[k] = coco_geometry(path, name, annotation.get("segmentation"), height, width)
    return geometries, label_indexes(path, np.array(classes, dtype=object), labels), names, ignored


def coco_lists(path: str) -> tuple[list[Any], list[Any], list[Any]]:
    """A COCO file's ``images``, ``annotations`` and ``categories``."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not a readable JSON file ({str(err).splitlines()[0]})") from err
    keys = ("images", "annotations", "categories")
    if not isinstance(data, dict) or not all(isinstance(data.get(key), list) for key in keys):
        raise InputError(f"{path}: not a COCO instances file (needs lists images, annotations and categories)")
    return data["images"], data["annotations"], data["categories"]


def coco_image(path: str, images: list[Any], name: str) -> dict[str, Any]:
    """The entry of ``images`` whose ``file_name`` has the base name ``name``; one line listing a few others."""
    named = [image for image in images if isinstance(image, dict) and isinstance(image.get("file_name"), str)]
    mine = [image for image in named if PurePath(image["file_name"].replace("\\", "/")).name == name]
    if not mine:
        others = sorted({str(image["file_name"]) for image in named})
        more = len(others) - SHOWN_NAMES
        shown = ", ".join(others[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")
        raise InputError(f"{path}: no image {name} in images (it has {shown or 'none'}; set scenes.X.image_path)")
    if len(mine) > 1:
        ids = ", ".join(str(image.get("id")) for image in mine)
        raise InputError(f"{path}: {len(mine)} images are named {name} (ids {ids}); one image per file name")
    return mine[0]


def coco_image_size(path: str, image: dict[str, Any], raster: RasterInfo) -> tuple[int, int]:
    """(height, width) of the raster, which the COCO image's ``height`` and ``width`` (when given) must match."""
    size = (image.get("height", raster.height), image.get("width", raster.width))
    if size != (raster.height, raster.width):
        raise InputError(
            f"{path}: image {image['file_name']} is {size[1]}x{size[0]} px but the raster {raster.path} is "
            f"{raster.width}x{raster.height} px (another image, or a resized one?)"
        )
    return raster.height, raster.width


def coco_category_names(
    path: str, categories: list[Any], annotations: list[dict[str, Any]], names: Sequence[str]
) -> list[str]:
    """Each annotation's category name; an id that ``categories`` lacks fails with one line naming both."""
    by_id = {c.get("id"): str(c.get("name")) for c in categories if isinstance(c, dict)}
    classes = []
    for annotation, name in zip(annotations, names, strict=True):
        category = annotation.get("category_id")
        if category not in by_id:
            known = ", ".join(f"{k} {v}" for k, v in list(by_id.items())[:SHOWN_NAMES])
            raise InputError(f"{path}: {name} has category_id {category}, not among categories ({known or 'none'})")
        classes.append(by_id[category])
    return classes


def coco_geometry(path: str, name: str, segmentation: Any, height: int, width: int) -> shapely.Geometry:
    """An annotation's ``segmentation`` (polygon rings, or a run-length mask) as a polygon in the image's pixels;
    several parts that do not join into one polygon fail with one line."""
    if isinstance(segmentation, list) and segmentation:
        parts = [coco_ring(path, name, ring) for ring in segmentation]
    elif isinstance(segmentation, dict):
        mask, row, col = rle_window(path, name, segmentation, height, width)
        transform = Affine.translation(col, row)
        parts = [shapely.geometry.shape(shape) for shape, _ in shapes(mask, mask=mask > 0, transform=transform)]
        if not parts:
            raise InputError(f"{path}: {name} has an empty mask; {NEEDS}")
    else:
        raise InputError(f"{path}: {name} has no segmentation (polygons or an RLE mask); {NEEDS}")
    if len(parts) == 1:
        return parts[0]
    joined = shapely.union_all(shapely.make_valid(np.array(parts, dtype=object)))
    pieces = [piece for piece in shapely.get_parts(joined) if isinstance(piece, shapely.Polygon)]
    if len(pieces) != 1:
        raise InputError(
            f"{path}: {name}'s segmentation has {len(pieces)} separate parts; a crown is one polygon: make them "
            "separate annotations if they are several crowns"
        )
    return pieces[0]


def coco_ring(path: str, name: str, ring: Any) -> shapely.Polygon:
    """A COCO polygon ring (flat ``x1, y1, x2, y2, ...``) as a polygon."""
    values = np.asarray(ring if isinstance(ring, list) else [], dtype=object)
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(numbers) != len(values) or len(numbers) < 6 or len(numbers) % 2 or not np.isfinite(numbers).all():
        raise InputError(
            f"{path}: {name} has a polygon of {len(values)} value(s); needs numbers x1, y1, x2, y2, ... of 3 "
            "points or more"
        )
    return shapely.Polygon(np.reshape(numbers, (-1, 2)))


def rle_window(
    path: str, name: str, segmentation: dict[str, Any], height: int, width: int
) -> tuple[np.ndarray, int, int]:
    """A run-length mask's foreground window: (mask uint8, its first row, its first column) in the image. Only
    the window is made, not the image: a crown's mask in a large scene stays small."""
    size, counts = segmentation.get("size"), segmentation.get("counts")
    if size != [height, width]:
        raise InputError(f"{path}: {name}'s mask is {size} (height, width), not the image's [{height}, {width}]")
    if isinstance(counts, str):
        runs = np.array(decode_rle_string(path, name, counts), dtype=np.int64)
    elif isinstance(counts, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        runs = np.array(counts, dtype=np.int64)
    else:
        raise InputError(f"{path}: {name}'s mask counts are neither a list of integers nor a COCO RLE string")
    if (runs < 0).any() or int(runs.sum()) != height * width:
        raise InputError(f"{path}: {name}'s mask runs cover {int(runs.sum())} pixels, not {height}x{width}")
    ends = np.cumsum(runs)
    starts, stops = (ends - runs)[1::2], ends[1::2]  # runs alternate background, foreground, starting with background
    starts, stops = starts[stops > starts], stops[stops > starts]
    if not len(starts):
        return np.zeros((0, 0), dtype=np.uint8), 0, 0
    first_col, last_col = int(starts.min() // height), int((stops.max() - 1) // height)
    flat = np.zeros((last_col - first_col + 1) * height, dtype=np.uint8)  # whole columns, column-major
    for start, stop in zip(starts - first_col * height, stops - first_col * height, strict=True):
        flat[start:stop] = 1
    window = flat.reshape(-1, height).T
    rows = np.flatnonzero(window.any(axis=1))
    return np.ascontiguousarray(window[rows[0] : rows[-1] + 1]), int(rows[0]), first_col


def decode_rle_string(path: str, name: str, text: str) -> list[int]:
    """COCO's compressed run lengths (pycocotools ``rleFrString``): each count in 5-bit groups, least significant
    first, as characters from ``0`` (48), bit 0x20 marking that another group follows and bit 0x10 of the last
    group the sign; from the fourth count on (index 3), each is stored as its difference to the count two before it."""
    counts: list[int] = []
    value = shift = 0
    for char in text:
        code = ord(char) - 48
        if not 0 <= code < 64:
            raise InputError(f"{path}: {name}'s mask counts hold {char!r}, not a COCO RLE character")
        value |= (code & 0x1F) << shift
        shift += 5
        if code & 0x20:
            continue
        if code & 0x10:
            value -= 1 << shift  # sign-extend the last group
        if len(counts) > 2:
            value += counts[-2]
        counts.append(value)
        value = shift = 0
    if shift:
        raise InputError(f"{path}: {name}'s mask counts end within a number (a cut RLE string)")
    return counts
