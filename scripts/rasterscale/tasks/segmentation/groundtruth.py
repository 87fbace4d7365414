"""Segmentation ground truth: class ids per pixel of a scene, tile by tile, and the training dataset over it.

Ground truth is either

* polygons in any OGR format (or GeoParquet) and any CRS, reprojected to the raster's CRS. Their class comes from
  ``label_column``: class names (matching ``labels``) or integer class ids; without it every polygon is
  :func:`default_class` (``labels[1]``: class 0 is what no polygon covers). Pixels whose centre lies in no
  polygon are class 0; where polygons overlap, the later one in the file wins. Or
* a class-id raster (``.tif``, ``.tiff``, ``.vrt``, ``.img``, ``.jp2``) on the scene's pixel grid (same CRS,
  transform and size), band 1 integer class ids; its nodata value (if any) and :data:`NODATA_CLASS` are ignored.

:func:`check_segmentation_truth` checks a file's header cheaply (dry run); :func:`read_segmentation_truth` reads
it into a :class:`SegmentationTruth`, whose :meth:`~SegmentationTruth.tile_classes` gives a window's class ids.
Truths pickle and cross forks (a raster is opened lazily, once per process), so dataloader workers can hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import shapely
from affine import Affine
from rasterio.crs import CRS
from rasterio.features import rasterize
from rasterio.windows import Window
from rasterio.windows import transform as window_transform

from rasterscale.errors import InputError
from rasterscale.raster.geo import GeometryIndex
from rasterscale.raster.geometry_checks import check_polygonal, file_kind, read_features, unreadable
from rasterscale.raster.headers import RasterInfo, check_raster, read_raster_header
from rasterscale.raster.imagery import ProcessRaster, decoding
from rasterscale.tasks.labels import label_indexes
from rasterscale.tasks.segmentation import NODATA_CLASS

RASTER_SUFFIXES = (".tif", ".tiff", ".vrt", ".img", ".jp2")
NEEDS = "segmentation needs polygons in a vector file with a CRS, or a class raster on the scene's grid"


def default_class(labels: Sequence[str]) -> int:
    """The class of a polygon without a class column: ``labels[1]``, since class 0 is what no polygon covers
    (``background``, or whatever ``labels[0]`` names); a segmenter has at least 2 classes."""
    return 1


def is_class_raster(path: str | Path) -> bool:
    return Path(path).suffix.lower() in RASTER_SUFFIXES


class SegmentationTruth:
    """Class ids of a scene's pixels, read window by window. ``labels``: the class names, ids 0..C-1."""

    path: str
    labels: tuple[str, ...]
    width: int
    height: int
    transform: Affine

    def tile_classes(self, window: Window) -> np.ndarray:
        """Class ids (uint8, shape (h, w)) of a window of the scene; :data:`NODATA_CLASS` where unknown."""
        raise NotImplementedError

    def classes_at(self, shape: tuple[int, int]) -> np.ndarray:
        """Class ids of the whole scene decimated to ``shape`` (rows, cols) (nearest pixel; for pictures)."""
        raise NotImplementedError


class PolygonTruth(SegmentationTruth):
    """Polygons in the raster's CRS with their class ids, rasterized window by window (pixel centres)."""

    def __init__(
        self, path: str, labels: Sequence[str], raster: RasterInfo, geometries: np.ndarray, classes: np.ndarray
    ) -> None:
        self.path, self.labels = path, tuple(labels)
        self.width, self.height, self.transform = raster.width, raster.height, raster.transform
        self.geometries, self.classes = geometries, classes.astype(np.uint8)
        self.index = GeometryIndex(geometries)

    def _burn(self, transform: Affine, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        corners = [transform @ (0, 0), transform @ (cols, rows)]
        (x0, y0), (x1, y1) = corners
        hits = self.index.query(shapely.box(min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)))
        if not len(hits):
            return np.zeros(shape, dtype=np.uint8)
        pairs = zip(self.geometries[hits], self.classes[hits].tolist(), strict=True)
        return rasterize(pairs, out_shape=shape, transform=transform, fill=0, all_touched=False, dtype="uint8")

    def tile_classes(self, window: Window) -> np.ndarray:
        return self._burn(window_transform(window, self.transform), (int(window.height), int(window.width)))

    def classes_at(self, shape: tuple[int, int]) -> np.ndarray:
        scaled = self.transform @ Affine.scale(self.width / shape[1], self.height / shape[0])
        return self._burn(scaled, shape)


class RasterTruth(SegmentationTruth):
    """A class-id raster aligned with the scene, read window by window through a lazily opened handle."""

    def __init__(self, path: str, labels: Sequence[str], info: RasterInfo) -> None:
        self.path, self.labels = path, tuple(labels)
        self.width, self.height, self.transform = info.width, info.height, info.transform
        self.nodata = info.nodata
        self.raster = ProcessRaster(path)

    def _checked(self, values: np.ndarray) -> np.ndarray:
        unknown = values != NODATA_CLASS
        if self.nodata is not None:
            unknown &= values != self.nodata
        bad = unknown & ((values < 0) | (values >= len(self.labels)))
        if bad.any():
            raise InputError(
                f"{self.path}: class id {int(values[bad][0])} is not one of 0..{len(self.labels) - 1} "
                f"({', '.join(self.labels)})"
            )
        classes = values.astype(np.uint8)  # ids in range are below 255; the rest become 255 next
        classes[~unknown] = NODATA_CLASS
        return classes

    def tile_classes(self, window: Window) -> np.ndarray:
        with decoding(self.path, window):
            return self._checked(self.raster.src.read(1, window=window))

    def classes_at(self, shape: tuple[int, int]) -> np.ndarray:
        with decoding(self.path):
            return self._checked(self.raster.src.read(1, out_shape=shape))


# --- checks ---------------------------------------------------------------------------------------------------


def _raster_of(raster: RasterInfo | str | Path) -> RasterInfo:
    return raster if isinstance(raster, RasterInfo) else check_raster(raster)


def _check_class_raster(path: str, raster: RasterInfo) -> RasterInfo:
    """The header of a class raster, checked against the scene's grid."""
    info = read_raster_header(path)
    if info.crs is None:
        raise InputError(f"{path}: class raster has no CRS")
    if not info.dtypes[0].startswith(("uint", "int")):
        raise InputError(
            f"{path}: class raster band 1 is {info.dtypes[0]}, not integer class ids (a raster of values, e.g. "
            "heights, is a target of task: regression)"
        )
    grid = (info.crs, info.width, info.height)
    if grid != (raster.crs, raster.width, raster.height) or not info.transform.almost_equals(raster.transform):
        raise InputError(
            f"{path}: class raster is not on the grid of {raster.path} (it is {info.width}x{info.height} px, "
            f"{_crs_name(info.crs)}, origin {info.transform.c:g},{info.transform.f:g}, pixel {info.transform.a:g}; "
            f"the scene is {raster.width}x{raster.height} px, {_crs_name(raster.crs)}, origin "
            f"{raster.transform.c:g},{raster.transform.f:g}, pixel {raster.transform.a:g})"
        )
    return info


def _crs_name(crs: CRS) -> str:
    return crs.to_string() if crs.to_epsg() else (crs.name or "custom CRS")


def _class_ids(path: str, values: Any, labels: Sequence[str], column: str) -> np.ndarray:
    """A class column (names, or integer ids) as uint8 class ids; one line naming the file when it does not fit."""
    values = np.asarray(values)
    if values.dtype.kind in "iu":
        bad = (values < 0) | (values >= len(labels))
        if bad.any():
            raise InputError(
                f"{path}: column '{column}' holds class id {int(values[bad][0])}, not one of 0..{len(labels) - 1} "
                f"({', '.join(labels)})"
            )
        return values.astype(np.uint8)
    names = np.array([str(v) for v in values], dtype=object)
    return label_indexes(path, names, list(labels)).astype(np.uint8)


def _read_polygon_frame(path: str, label_column: str | None) -> tuple[Any, list[str]]:
    """A vector file's features (:func:`rasterscale.raster.geometry_checks.read_features`: a frame, and their names
    for messages), with its class column when one is given."""
    frame, names = read_features(path, NEEDS)
    fields = [column for column in frame.columns if column != frame.geometry.name]
    if label_column and label_column not in fields:
        raise InputError(f"{path}: no column '{label_column}' (columns: {', '.join(map(str, fields))})")
    return frame, names


def _vector_header(path: str) -> tuple[int, Any, Any]:
    """(feature count, CRS, bounds in that CRS) of a vector file, without reading its features."""
    import pyogrio

    try:
        if path.endswith(".parquet"):
            import geopandas as gpd

            frame = gpd.read_parquet(path)
            return len(frame), frame.crs, frame.total_bounds
        info = pyogrio.read_info(path, force_total_bounds=True)
        return int(info["features"]), info["crs"], info["total_bounds"]
    except Exception as err:  # pyogrio and pyarrow raise many types
        raise unreadable(path, err, NEEDS) from None


def _overlaps_raster(crs: Any, bounds: Any, raster: RasterInfo) -> bool:
    """Whether a layer's bounds (in its ``crs``) meet the raster's footprint (True when they cannot be told)."""
    import numpy as np
    from rasterio.warp import transform_bounds

    if bounds is None or not np.all(np.isfinite(bounds)):
        return True
    left, bottom, right, top = transform_bounds(crs, raster.crs, *bounds)
    corners = [raster.transform @ (0, 0), raster.transform @ (raster.width, raster.height)]
    (x0, y0), (x1, y1) = corners
    return left <= max(x0, x1) and right >= min(x0, x1) and bottom <= max(y0, y1) and top >= min(y0, y1)


def check_segmentation_truth(
    path: str | Path, raster: RasterInfo | str | Path, labels: Sequence[str], label_column: str | None = None
) -> None:
    """The dry run's checks of a ground-truth file, as its job reads it: exists, not empty, has a CRS, meets the
    raster, its geometries are polygons (:func:`rasterscale.raster.geometry_checks.check_polygonal`; empty ones
    are left out), its class names are known; a class raster lies on the scene's grid. One-line
    :class:`InputError` naming the file."""
    _checked_truth(str(path), _raster_of(raster), labels, label_column)


def read_segmentation_truth(
    path: str | Path, raster: RasterInfo | str | Path, labels: Sequence[str], label_column: str | None = None
) -> SegmentationTruth:
    """A scene's ground truth (polygons reprojected to the raster's CRS, or an aligned class raster), checked as
    the dry run checks it (:func:`check_segmentation_truth`)."""
    path = str(path)
    raster = _raster_of(raster)
    checked = _checked_truth(path, raster, labels, label_column)
    if isinstance(checked, RasterInfo):
        return RasterTruth(path, labels, checked)
    frame, classes = checked
    if frame.crs != raster.crs:
        frame = frame.to_crs(raster.crs)
    return PolygonTruth(path, labels, raster, frame.geometry.to_numpy(), classes)


def _checked_truth(
    path: str, raster: RasterInfo, labels: Sequence[str], label_column: str | None
) -> RasterInfo | tuple[Any, np.ndarray]:
    """A class raster's header, or the ground truth's polygons (a frame, in their own CRS; empty geometries left
    out) with their class ids, checked (:func:`check_segmentation_truth`)."""
    if not Path(path).exists():
        raise InputError(f"{path}: segmentation ground truth not found")
    if is_class_raster(path):
        return _check_class_raster(path, raster)
    kind = file_kind(path) if Path(path).suffix.lower() in (".csv", ".xml") else None
    if kind is not None:  # OGR reads a CSV as a table: its lack of a CRS is beside the point
        raise InputError(f"{path}: {kind}; {NEEDS}")
    count, crs, bounds = _vector_header(path)
    if count == 0:
        raise InputError(f"{path}: ground truth holds no polygons")
    if crs is None:
        raise InputError(f"{path}: ground-truth polygons have no CRS")
    if not _overlaps_raster(crs, bounds, raster):
        raise InputError(f"{path}: no polygon overlaps the raster {raster.path} (another place, or a wrong CRS?)")
    frame, names = _read_polygon_frame(path, label_column)
    if label_column:
        classes = _class_ids(path, frame[label_column].to_numpy(), labels, label_column)
    else:
        classes = np.full(len(frame), default_class(labels), dtype=np.uint8)
    kept = check_polygonal(path, frame.geometry.to_numpy(), names, NEEDS, empty_ok=True)
    return frame[kept], classes[kept]
