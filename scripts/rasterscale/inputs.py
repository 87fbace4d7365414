"""Checks of user inputs (rasters and annotations), each failing with one line that names the file.

These run at workflow load (``snakemake -n``) for inputs that already exist, and again inside the rules.
They read metadata only, never pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import rasterio
from affine import Affine
from rasterio.crs import CRS
from rasterio.errors import RasterioIOError

from rasterscale.geo import geometries_to_pixel_boxes

RGB_BANDS = 3


class InputError(ValueError):
    """A problem with an input file, worded as one line that names the file."""


@dataclass(frozen=True)
class RasterInfo:
    path: str
    width: int
    height: int
    count: int
    crs: CRS
    transform: Affine
    block_shapes: tuple[tuple[int, int], ...]

    @property
    def is_tiled(self) -> bool:
        """Internally tiled (square-ish blocks), not striped: windowed reads touch only nearby blocks."""
        return all(cols < self.width or self.width <= cols == rows for rows, cols in self.block_shapes)


def check_raster(path: str | Path) -> RasterInfo:
    """Open a raster's header and check it can feed an RGB model in a georeferenced way."""
    path = str(path)
    if not Path(path).exists():
        raise InputError(f"{path}: raster not found")
    try:
        with rasterio.open(path) as src:
            info = RasterInfo(path, src.width, src.height, src.count, src.crs, src.transform, tuple(src.block_shapes))
    except RasterioIOError as err:
        raise InputError(f"{path}: not a readable raster ({err})") from err
    if info.crs is None:
        raise InputError(
            f"{path}: raster has no CRS; outputs could not be placed on the map (set one with gdal_edit.py -a_srs)"
        )
    if info.transform == Affine.identity():
        raise InputError(f"{path}: raster has no geotransform (pixel coordinates only)")
    if info.count < RGB_BANDS:
        raise InputError(f"{path}: raster has {info.count} band(s); the model needs {RGB_BANDS} (RGB)")
    return info


@dataclass(frozen=True)
class Annotations:
    boxes: np.ndarray  # (N, 4) pixel boxes in the raster
    labels: np.ndarray  # (N,) int64 label indices (0-based into the label list)


def read_annotations(
    path: str | Path,
    raster: RasterInfo,
    labels: list[str],
    label_column: str | None = None,
) -> Annotations:
    """Ground-truth boxes of a scene in the raster's pixel space; bad files fail with one line."""
    path = str(path)
    if not Path(path).exists():
        raise InputError(f"{path}: annotation file not found")
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
        names = frame[label_column].astype(str).to_numpy()
        unknown = sorted(set(names) - set(labels))
        if unknown:
            raise InputError(f"{path}: label(s) {', '.join(unknown)} are not in model.labels ({', '.join(labels)})")
        index = {name: k for k, name in enumerate(labels)}
        label_ids = np.array([index[name] for name in names], dtype=np.int64)
    else:
        label_ids = np.zeros(len(frame), dtype=np.int64)
    boxes = geometries_to_pixel_boxes(frame.geometry.to_numpy(), raster.transform)
    inside = (boxes[:, 2] > 0) & (boxes[:, 3] > 0) & (boxes[:, 0] < raster.width) & (boxes[:, 1] < raster.height)
    if not inside.any():
        raise InputError(f"{path}: no annotation overlaps the raster {raster.path}")
    return Annotations(boxes[inside], label_ids[inside])
