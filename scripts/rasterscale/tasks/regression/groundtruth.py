"""Regression targets: a float raster of the values to learn (e.g. canopy height in metres), read window by window on
the scene's pixel grid.

``scenes.X.annotations`` of a regression scene is a float raster (``.tif``, ``.tiff``, ``.vrt``, ``.img``,
``.jp2``) with one band per output value (``model.labels``). It may be on the scene's grid (same CRS, transform and
size: read as it is), or in any CRS and resolution: then it is resampled on the fly, window by window, through a
GDAL warped VRT with the scene's CRS, transform and size (bilinear), never read whole. No data is its nodata value,
NaN, and anything outside its extent; it comes out as NaN (:class:`TargetRaster`).

:func:`check_targets` checks a target's header cheaply (dry run): it exists, is a float raster (an integer one is
a class raster, for segmentation), has as many bands as labels, overlaps the scene, and holds data (a small
decimated read). One-line :class:`~rasterscale.errors.InputError` naming the file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from rasterio.crs import CRS
from rasterio.enums import Resampling
from rasterio.vrt import WarpedVRT
from rasterio.warp import transform_bounds
from rasterio.windows import Window

from rasterscale.errors import InputError
from rasterscale.raster.headers import RasterInfo, check_raster, read_raster_header
from rasterscale.raster.imagery import decoding
from rasterscale.raster.remote import open_raster

RASTER_SUFFIXES = (".tif", ".tiff", ".vrt", ".img", ".jp2")
CHECK_SIDE = 256  # longest side of the decimated read that checks a target holds data


def on_grid(info: RasterInfo, scene: RasterInfo) -> bool:
    """Whether a target lies on the scene's pixel grid (read as it is, not resampled)."""
    same = (info.crs, info.width, info.height) == (scene.crs, scene.width, scene.height)
    return same and info.transform.almost_equals(scene.transform)


class TargetRaster:
    """A scene's targets on its pixel grid, window by window: float32 (K, h, w), NaN where there is no data.

    The target file is opened lazily, once per process (it pickles and crosses forks, so dataloader workers can
    hold it); a target off the scene's grid is read through a warped VRT (bilinear)."""

    def __init__(self, path: str, scene: RasterInfo, info: RasterInfo) -> None:
        self.path, self.count = path, info.count
        self.width, self.height, self.transform, self.crs = scene.width, scene.height, scene.transform, scene.crs
        self.nodata = info.nodata
        self.aligned = on_grid(info, scene)
        self._handles: tuple[Any, ...] | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": None, "_pid": None}

    @property
    def src(self) -> Any:
        """The dataset to read windows of the scene from: the target itself, or its warped VRT."""
        if self._handles is None or self._pid != os.getpid():
            src = open_raster(self.path)
            if self.aligned:
                self._handles = (src,)
            else:
                source_nodata = {} if self.nodata is None else {"src_nodata": self.nodata}
                vrt = WarpedVRT(
                    src,
                    crs=self.crs,
                    transform=self.transform,
                    width=self.width,
                    height=self.height,
                    resampling=Resampling.bilinear,
                    nodata=math.nan,
                    dtype="float32",
                    **source_nodata,
                )
                self._handles = (vrt, src)
            self._pid = os.getpid()
        return self._handles[0]

    def _values(self, data: np.ndarray) -> np.ndarray:
        values = data.astype(np.float32, copy=False)
        if self.nodata is not None and not math.isnan(self.nodata):
            values[data == self.nodata] = np.nan
        return values

    def read(self, window: Window) -> np.ndarray:
        """The targets of a window of the scene, (K, h, w) float32, NaN where there is no data."""
        with decoding(self.path, window):
            return self._values(self.src.read(window=window, boundless=False))

    def read_decimated(self, shape: tuple[int, int]) -> np.ndarray:
        """The targets of the whole scene decimated to ``shape`` (rows, cols) (nearest; for pictures and checks)."""
        with decoding(self.path):
            return self._values(self.src.read(out_shape=(self.count, *shape), resampling=Resampling.nearest))


def is_target_raster(path: str | Path) -> bool:
    return Path(path).suffix.lower() in RASTER_SUFFIXES


def _crs_name(crs: CRS | None) -> str:
    if crs is None:
        return "no CRS"
    return crs.to_string() if crs.to_epsg() else (crs.name or "custom CRS")


def _overlaps(info: RasterInfo, scene: RasterInfo) -> bool:
    """Whether a target's extent meets the scene's (in the scene's CRS)."""
    (x0, y0), (x1, y1) = info.transform @ (0, 0), info.transform @ (info.width, info.height)
    left, bottom, right, top = transform_bounds(info.crs, scene.crs, min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
    (sx0, sy0), (sx1, sy1) = scene.transform @ (0, 0), scene.transform @ (scene.width, scene.height)
    return left < max(sx0, sx1) and right > min(sx0, sx1) and bottom < max(sy0, sy1) and top > min(sy0, sy1)


def _target_header(path: str, scene: RasterInfo, labels: Sequence[str]) -> RasterInfo:
    """A target's header, checked against the scene and the labels (everything but its data)."""
    if not Path(path).exists():
        raise InputError(f"{path}: regression target raster not found")
    if not is_target_raster(path):
        raise InputError(
            f"{path}: regression needs a float raster of target values ({', '.join(RASTER_SUFFIXES)}), e.g. heights "
            "in metres; polygons and boxes are for task: segmentation or detection"
        )
    info = read_raster_header(path)
    kinds = sorted({dtype for dtype in info.dtypes if not dtype.startswith("float")})
    if kinds:
        raise InputError(
            f"{path}: target raster is {'/'.join(kinds)}; regression needs a float raster of values (e.g. heights "
            "in metres); integer class rasters are for task: segmentation"
        )
    if info.count != len(labels):
        raise InputError(
            f"{path}: target raster has {info.count} band(s) but model.labels names {len(labels)} output value(s) "
            f"({', '.join(labels)}): one band per value"
        )
    if info.crs is None:
        raise InputError(f"{path}: target raster has no CRS")
    if not on_grid(info, scene) and not _overlaps(info, scene):
        raise InputError(
            f"{path}: target raster ({_crs_name(info.crs)}) does not overlap the scene {scene.path} "
            f"({_crs_name(scene.crs)}): another place, or a wrong CRS?"
        )
    return info


def check_targets(path: str | Path, scene: RasterInfo | str | Path, labels: Sequence[str]) -> None:
    """Cheap checks of a scene's target raster (dry run; see the module docstring), one line naming the file."""
    read_targets(path, scene, labels)


def read_targets(path: str | Path, scene: RasterInfo | str | Path, labels: Sequence[str]) -> TargetRaster:
    """A scene's checked targets on its grid (:class:`TargetRaster`); a target that holds no data over the scene
    (a small decimated read) fails naming the file."""
    path = str(path)
    scene = scene if isinstance(scene, RasterInfo) else check_raster(scene)
    target = TargetRaster(path, scene, _target_header(path, scene, labels))
    scale = max(1.0, max(scene.width, scene.height) / CHECK_SIDE)
    shape = (max(1, round(scene.height / scale)), max(1, round(scene.width / scale)))
    try:
        sample = target.read_decimated(shape)
    except rasterio.errors.RasterioError as err:
        raise InputError(f"{path}: target raster cannot be read ({str(err).splitlines()[0]})") from None
    if not np.isfinite(sample).any():
        raise InputError(f"{path}: target raster holds no data over the scene {scene.path} (all nodata)")
    return target
