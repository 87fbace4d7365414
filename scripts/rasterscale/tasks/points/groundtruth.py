"""Points' ground truth (``scenes.X.annotations``): a scene's true points (tree tops, birds, animals) in its raster's
pixels with their classes, each file checked with one line that names it.

Points come as

* any OGR vector file or GeoParquet in any CRS: reprojected to the raster's CRS, then into its pixels (x = column,
  y = row; a pixel's centre at +0.5) through its transform. A Point is a point, a MultiPoint its points; a polygon
  or multipolygon (a box or an outline) is its centroid, taken in the raster's CRS (after the reprojection, so in
  the same metres as the raster's pixels; the inverse transform is affine and keeps centroids) and counted
  (``centroids``). An empty geometry or a line fails with one line naming the feature (OGR feature id, GeoParquet
  row), as does a file without a CRS. A point's class is its ``label_column`` (class names among the labels);
  without one every point is class 0;
* DeepForest's point CSV (``image_path,x,y,label`` in the raster's pixels, as DeepForest 2's
  ``utilities.read_file`` reads a CSV with ``x`` and ``y`` columns), or its box CSV (``image_path,xmin,ymin,xmax,
  ymax,label``): each box is its centre, counted (``centroids``);
* COCO keypoints (``.json``): of its ``images``, the one whose ``file_name`` is the raster's file name (or
  ``scenes.X.image_path``; compared by base name); each keypoint ``x, y, v`` of its ``annotations`` with ``v > 0``
  is a point (``v = 0``: not labelled), classed by its ``category_id``'s name; an annotation without keypoints but
  with a ``bbox`` ``[x, y, width, height]`` is the box's centre, counted (``centroids``). Coordinates are taken as
  they are, in the image's continuous pixel frame (0, 0 the top-left corner of the top-left pixel), as its boxes
  and polygons are. (A ``.json`` that is GeoJSON is read as a vector file.)

A CSV or COCO file names its image: only the points of the scene's raster are used, the others are counted
(``ignored``) in the log. Points off the raster are left out (ground truth of a larger area than the scene's);
none on it fails.

Torch-free: :func:`check_annotations` runs at plan time (``snakemake -n``), :func:`read_points` in the training
and evaluation jobs.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import shapely
from affine import Affine

from rasterscale.errors import InputError
from rasterscale.raster.geometry_checks import check_of_kinds, check_present, read_features
from rasterscale.raster.headers import RasterInfo
from rasterscale.tasks.labels import label_indexes

LOGGER = logging.getLogger(__name__)
COCO_SUFFIX = ".json"
POINT_COLUMNS = ["image_path", "x", "y", "label"]
BOX_COLUMNS = ["image_path", "xmin", "ymin", "xmax", "ymax", "label"]
POINT, MULTIPOINT = shapely.GeometryType.POINT, shapely.GeometryType.MULTIPOINT
POLYGON, MULTIPOLYGON = shapely.GeometryType.POLYGON, shapely.GeometryType.MULTIPOLYGON
NEEDS = "points need Point or MultiPoint features, or boxes and polygons taken as their centroids"
POINT_FILES = (
    "points come as Point features in a vector file (GeoPackage, GeoJSON, Shapefile, GeoParquet), DeepForest's "
    "point CSV or COCO keypoints"
)
SHOWN_NAMES = 5  # image names an error lists


@dataclass(frozen=True)
class PointTruth:
    """A scene's true points in its raster's pixels and their classes."""

    xy: np.ndarray  # (N, 2) float64 pixel coordinates (col, row) in the raster; a pixel's centre is at +0.5
    labels: np.ndarray  # (N,) int64 indexes into the label list
    ignored: int = 0  # rows of a CSV/COCO file naming another image (COCO: their points)
    centroids: int = 0  # features given as boxes or polygons, taken as their centroids (of the points kept)


@dataclass(frozen=True)
class FoundPoints:
    """A file's points of the scene before they are cut to the raster: pixels, label indexes, which are centroids
    of boxes or polygons, and how many points of other images were passed over."""

    xy: np.ndarray  # (N, 2) float64
    labels: np.ndarray  # (N,) int64
    centroid: np.ndarray  # (N,) bool
    ignored: int = 0


def read_points(
    path: str | Path,
    raster: RasterInfo,
    labels: list[str],
    label_column: str | None = None,
    image_path: str | None = None,
) -> PointTruth:
    """A scene's true points in its raster's pixels, checked (module docstring); bad files fail with one line.

    ``.csv`` is read as DeepForest's point (or box) CSV and ``.json`` as COCO keypoints, keeping the points whose
    image is ``image_path`` (compared by file name; default: the raster's file name); anything else as an OGR
    vector file or GeoParquet (``label_column`` names its class column). Class names map through ``labels``."""
    path = str(path)
    if not Path(path).exists():
        raise InputError(f"{path}: point ground truth not found")
    image = PurePath((image_path or raster.path).replace("\\", "/")).name
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        found = read_csv_points(path, labels, image)
    elif suffix == COCO_SUFFIX:
        data = load_json(path)
        if is_geojson(data):
            found = read_vector_points(path, raster, labels, label_column)
        else:
            found = read_coco_points(path, data, raster, labels, image)
    else:
        found = read_vector_points(path, raster, labels, label_column)
    x, y = found.xy[:, 0], found.xy[:, 1]
    inside = (x >= 0) & (x < raster.width) & (y >= 0) & (y < raster.height)  # NaN (unprojectable) is outside
    if not inside.any():
        raise InputError(f"{path}: no point lies on the raster {raster.path}")
    if not inside.all():
        LOGGER.info("%s: %d of %d point(s) off the raster %s left out", path, int((~inside).sum()), len(x), raster.path)
    return PointTruth(
        xy=np.ascontiguousarray(found.xy[inside], dtype=np.float64),
        labels=found.labels[inside].astype(np.int64),
        ignored=found.ignored,
        centroids=int(found.centroid[inside].sum()),
    )


def check_annotations(
    path: str, raster: RasterInfo, labels: list[str], label_column: str | None, image: str
) -> list[tuple[str, str]]:
    """The dry run's check of a scene's ground truth: all of :func:`read_points`'s; a warning (``scenes.X.
    centroids_ok`` silences it) when some points are the centroids of boxes or polygons: a box or crown file given
    for points, whose centres are not the tree tops a model should learn."""
    truth = read_points(path, raster, labels, label_column, image or None)
    if not truth.centroids:
        return []
    line = (
        f"{path}: {truth.centroids} of {len(truth.xy)} annotations are boxes or polygons: taken as points at their "
        "centroids; set scenes.{scene}.centroids_ok: true if they are meant"
    )
    return [("centroids_ok", line)]


def to_pixels(x: np.ndarray, y: np.ndarray, transform: Affine) -> np.ndarray:
    """Coordinates in the raster's CRS as (N, 2) pixel coordinates (column, row), through the inverse transform."""
    inverse = ~transform
    cols = inverse.a * x + inverse.b * y + inverse.c
    rows = inverse.d * x + inverse.e * y + inverse.f
    return np.column_stack([cols, rows]).astype(np.float64).reshape(-1, 2)


def of_image(name: str, image: str) -> bool:
    """Whether a CSV row's or COCO entry's image name is ``image`` (compared by file name, ``\\`` as ``/``)."""
    return PurePath(name.replace("\\", "/")).name == image


# --- OGR vector files, GeoParquet -------------------------------------------------------------------------------


def read_vector_points(path: str, raster: RasterInfo, labels: list[str], label_column: str | None) -> FoundPoints:
    """Points (pixels of the raster) and label indexes of an OGR vector file or GeoParquet: points, multipoints
    (their points) and (multi)polygons (their centroids in the raster's CRS); an empty geometry or a line fails
    with one line naming it."""
    frame, names = read_features(path, POINT_FILES)
    if len(frame) == 0:
        raise InputError(f"{path}: ground truth holds no points")
    if label_column and label_column not in frame.columns:
        raise InputError(f"{path}: no column '{label_column}' (columns: {', '.join(map(str, frame.columns))})")
    geometries = np.asarray(frame.geometry.to_numpy(), dtype=object)
    check_present(path, geometries, names, NEEDS)
    check_of_kinds(path, geometries, names, {POINT, MULTIPOINT, POLYGON, MULTIPOLYGON}, "points or polygons", NEEDS)
    if frame.crs is None:
        raise InputError(f"{path}: ground-truth points have no CRS")
    if frame.crs != raster.crs:
        frame = frame.to_crs(raster.crs)
    if label_column:
        label_ids = label_indexes(path, frame[label_column].astype(str).to_numpy(), labels)
    else:
        label_ids = np.zeros(len(frame), dtype=np.int64)
    geometries = np.asarray(frame.geometry.to_numpy(), dtype=object)
    areas = np.isin(shapely.get_type_id(geometries), [POLYGON, MULTIPOLYGON])
    if areas.any():
        geometries[areas] = shapely.centroid(geometries[areas])
    parts, index = shapely.get_parts(geometries, return_index=True)  # a multipoint's points, in order
    xy = to_pixels(shapely.get_x(parts), shapely.get_y(parts), raster.transform)  # an empty part: NaN, left out
    return FoundPoints(xy, label_ids[index], areas[index])


# --- DeepForest CSV ---------------------------------------------------------------------------------------------


def read_csv_points(path: str, labels: list[str], image: str) -> FoundPoints:
    """The points of ``image`` in a DeepForest point or box CSV; the other images' rows are counted."""
    images, xy, names, boxes = read_deepforest_csv(path)
    mine = np.array([of_image(name, image) for name in images])
    ignored = int((~mine).sum())
    if not mine.any():
        shown = ", ".join(sorted(set(images))[:SHOWN_NAMES])
        raise InputError(f"{path}: no point for image {image} (it has points of {shown}; set scenes.X.image_path)")
    if ignored:
        LOGGER.warning("%s: %d point(s) of other images than %s ignored", path, ignored, image)
    label_ids = label_indexes(path, np.array(names, dtype=object)[mine].astype(str), labels)
    return FoundPoints(xy[mine], label_ids, np.full(int(mine.sum()), boxes), ignored)


def read_deepforest_csv(path: str) -> tuple[list[str], np.ndarray, list[str], bool]:
    """A DeepForest CSV's rows, checked: each row's image name, point (pixels; a box's centre) and class name, and
    whether the rows are boxes. Read with the csv module, not pandas: the plan checks every scene's file."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames
            if not columns:
                raise InputError(f"{path}: ground truth holds no points")
            boxes = is_box_csv(path, list(columns))
            rows = [(reader.line_num, row) for row in reader]
            extra = next((line for line, row in rows if None in row), None)  # DictReader's key of surplus fields
            if extra is not None:
                raise InputError(f"{path}: line {extra} has more fields than the header (a comma inside a value?)")
    except (csv.Error, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a readable CSV ({str(err).splitlines()[0]})") from err
    if not rows:
        raise InputError(f"{path}: ground truth holds no points")
    keys = (BOX_COLUMNS if boxes else POINT_COLUMNS)[1:-1]
    values = np.array([[number(row.get(key)) for key in keys] for _, row in rows], dtype=np.float64)
    bad = ~np.isfinite(values).all(axis=1)
    if boxes:
        bad |= (values[:, 2] < values[:, 0]) | (values[:, 3] < values[:, 1])
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        line, row = rows[first]
        shown = ", ".join(str(row.get(key) or "").strip() or "nan" for key in keys)
        needs = "numbers, xmin <= xmax, ymin <= ymax" if boxes else "numbers x, y"
        raise InputError(f"{path}: line {line} has a bad {'box' if boxes else 'point'} ({shown}); needs {needs}")
    xy = (values[:, :2] + values[:, 2:]) / 2 if boxes else values
    images = [str(row.get("image_path") or "") for _, row in rows]
    return images, xy, [str(row.get("label") or "") for _, row in rows], boxes


def is_box_csv(path: str, columns: list[str]) -> bool:
    """Whether a CSV's header is a box CSV's (:data:`BOX_COLUMNS`), not a point CSV's (:data:`POINT_COLUMNS`,
    preferred when it has both); one line naming the missing columns of the closer kind when it is neither."""
    point_missing = [c for c in POINT_COLUMNS if c not in columns]
    box_missing = [c for c in BOX_COLUMNS if c not in columns]
    if not point_missing or not box_missing:
        return bool(point_missing)
    boxes = len(box_missing) < len(point_missing)
    missing, kind = (box_missing, "box") if boxes else (point_missing, "point")
    raise InputError(
        f"{path}: DeepForest {kind} CSV lacks column(s) {', '.join(missing)} (points need {','.join(POINT_COLUMNS)}, "
        f"or boxes {','.join(BOX_COLUMNS)})"
    )


def number(value: Any) -> float:
    """A CSV field as a float; NaN for anything else (a bad row)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# --- COCO keypoints ---------------------------------------------------------------------------------------------


def is_geojson(data: Any) -> bool:
    """Whether a ``.json`` file's content is GeoJSON (a FeatureCollection or Feature): read as a vector file."""
    return isinstance(data, dict) and data.get("type") in ("FeatureCollection", "Feature")


def load_json(path: str) -> Any:
    """A JSON file's content; one line when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not a readable JSON file ({str(err).splitlines()[0]})") from err


def read_coco_points(path: str, data: Any, raster: RasterInfo, labels: list[str], image: str) -> FoundPoints:
    """The points of ``image`` in a COCO keypoints file (``data``, its content) and their label indexes; the
    points of the other images' annotations are counted."""
    keys = ("images", "annotations", "categories")
    if not isinstance(data, dict) or not all(isinstance(data.get(key), list) for key in keys):
        raise InputError(f"{path}: not a COCO keypoints file (needs lists images, annotations and categories)")
    entry = coco_image(path, data["images"], image, raster)
    by_id = {c.get("id"): str(c.get("name")) for c in data["categories"] if isinstance(c, dict)}
    points: list[np.ndarray] = []
    classes: list[str] = []
    centroid: list[bool] = []
    ignored = 0
    for k, annotation in enumerate(data["annotations"]):
        if not isinstance(annotation, dict):
            raise InputError(f"{path}: annotations[{k}] is no object; COCO annotations are objects")
        name = f"annotation {annotation.get('id', f'#{k}')}"
        xy, from_box = annotation_points(path, name, annotation)
        if annotation.get("image_id") != entry.get("id"):
            ignored += len(xy)
            continue
        category = annotation.get("category_id")
        if category not in by_id:
            known = ", ".join(f"{key} {value}" for key, value in list(by_id.items())[:SHOWN_NAMES])
            raise InputError(f"{path}: {name} has category_id {category}, not among categories ({known or 'none'})")
        points.append(xy)
        classes.extend([by_id[category]] * len(xy))
        centroid.extend([from_box] * len(xy))
    if not classes:
        raise InputError(
            f"{path}: no point of image {entry['file_name']} (id {entry.get('id')}): no keypoint with v > 0, no bbox"
        )
    if ignored:
        LOGGER.info("%s: %d point(s) of other images than %s ignored", path, ignored, entry["file_name"])
    label_ids = label_indexes(path, np.array(classes, dtype=object), labels)
    return FoundPoints(np.concatenate(points), label_ids, np.array(centroid, dtype=bool), ignored)


def coco_image(path: str, images: list[Any], name: str, raster: RasterInfo) -> dict[str, Any]:
    """The entry of ``images`` whose ``file_name`` has the base name ``name``, whose ``width`` and ``height`` (when
    given) must be the raster's; one line listing a few others when there is none."""
    named = [image for image in images if isinstance(image, dict) and isinstance(image.get("file_name"), str)]
    mine = [image for image in named if of_image(image["file_name"], name)]
    if not mine:
        others = sorted({str(image["file_name"]) for image in named})
        more = len(others) - SHOWN_NAMES
        shown = ", ".join(others[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")
        raise InputError(f"{path}: no image {name} in images (it has {shown or 'none'}; set scenes.X.image_path)")
    if len(mine) > 1:
        ids = ", ".join(str(image.get("id")) for image in mine)
        raise InputError(f"{path}: {len(mine)} images are named {name} (ids {ids}); one image per file name")
    image = mine[0]
    size = (image.get("width", raster.width), image.get("height", raster.height))
    if size != (raster.width, raster.height):
        raise InputError(
            f"{path}: image {image['file_name']} is {size[0]}x{size[1]} px but the raster {raster.path} is "
            f"{raster.width}x{raster.height} px (another image, or a resized one?)"
        )
    return image


def annotation_points(path: str, name: str, annotation: dict[str, Any]) -> tuple[np.ndarray, bool]:
    """An annotation's points in the image's pixels, (N, 2): its keypoints with ``v > 0``, or without keypoints
    its ``bbox``'s centre (then True)."""
    keypoints = annotation.get("keypoints")
    if keypoints:
        values = coco_numbers(path, name, "keypoints", keypoints)
        if len(values) % 3:
            raise InputError(
                f"{path}: {name} has {len(values)} keypoint value(s), not a multiple of 3 (x, y, v per keypoint)"
            )
        triples = np.reshape(values, (-1, 3))
        return triples[triples[:, 2] > 0, :2], False
    bbox = annotation.get("bbox")
    if bbox is None:
        raise InputError(f"{path}: {name} has neither keypoints nor a bbox; points need keypoints [x, y, v, ...]")
    box = coco_numbers(path, name, "bbox", bbox)
    if len(box) != 4 or box[2] < 0 or box[3] < 0:
        raise InputError(f"{path}: {name} has a bad bbox ({bbox}); needs [x, y, width, height], width, height >= 0")
    return np.array([[box[0] + box[2] / 2, box[1] + box[3] / 2]]), True


def coco_numbers(path: str, name: str, key: str, values: Any) -> np.ndarray:
    """An annotation's list ``key`` as finite float64 numbers; one line for anything else."""
    items = values if isinstance(values, list) else [values]
    numbers = [float(v) for v in items if isinstance(v, int | float) and not isinstance(v, bool)]
    if not isinstance(values, list) or len(numbers) != len(items) or not np.isfinite(numbers).all():
        raise InputError(f"{path}: {name}'s {key} are not a list of numbers")
    return np.array(numbers, dtype=np.float64)
