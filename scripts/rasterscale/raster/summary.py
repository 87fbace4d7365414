"""A project's summary raster: a coarse COG over the project's layer, cells of ``project.summary_cell`` metres in
the project's CRS (:func:`grid_cell`: in a projected CRS's own unit, or degrees of latitude in a geographic CRS),
aligned on multiples of the cell (so two runs' summaries overlay).

- Objects (detection's boxes, instances' crowns): objects per hectare, the count of objects whose bounding box
  is centred in a cell over the cell's area. Read from GeoParquet files (a partitioned layer's, or the single
  file) one record batch at a time and only their GeoParquet 1.1 ``bbox`` covering column (the geometry is not
  decoded; a file without it has its geometries' bounds computed instead). The grid's extent comes from each
  file's metadata (its ``bbox``), not from its rows.
- Rasters (segmentation's classes, regression's values): a WarpedVRT of the project's mosaic onto a grid of
  ``samples`` × ``samples`` points a cell, read one strip of cells at a time (GDAL picks the overview nearest that
  resolution). Classes: the share of each class among a cell's points with data (a band per class); values: the
  mean of a cell's points with data (a band per value), the points averaging the pixels under them.

Cells without data are nodata (objects: 0 is a count; every cell is written).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import shapely

from rasterscale.atomic import atomic_path

NODATA = -1.0
HECTARE = 10_000.0  # m²
EARTH_RADIUS_M = 6_371_008.8  # the mean radius: a geographic CRS's cells' areas on the sphere
STRIP_CELLS = 64  # rows of cells a raster summary reads at once


@dataclass(frozen=True)
class CellGrid:
    """A summary's grid: its west and north edges, its cell size and its size in cells."""

    west: float
    north: float
    cell: float
    width: int
    height: int

    @classmethod
    def covering(cls, bounds: tuple[float, float, float, float], cell: float) -> CellGrid:
        """The grid of cells aligned on multiples of ``cell`` that covers ``bounds`` (at least one cell)."""
        xmin, ymin, xmax, ymax = bounds
        west, south = math.floor(xmin / cell) * cell, math.floor(ymin / cell) * cell
        width, height = math.ceil((xmax - west) / cell), math.ceil((ymax - south) / cell)
        return cls(west, south + max(1, height) * cell, cell, max(1, width), max(1, height))

    @property
    def transform(self) -> Any:
        from affine import Affine

        return Affine(self.cell, 0.0, self.west, 0.0, -self.cell, self.north)

    def cells_of(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The flat index (row-major) of the cell holding each point (one on the grid's east or south edge: the
        cell inside); -1 for a point outside the grid."""
        east, south = self.west + self.width * self.cell, self.north - self.height * self.cell
        inside = (x >= self.west) & (x <= east) & (y <= self.north) & (y >= south)
        col = np.clip(np.floor((x - self.west) / self.cell).astype(np.int64), 0, self.width - 1)
        row = np.clip(np.floor((self.north - y) / self.cell).astype(np.int64), 0, self.height - 1)
        return np.where(inside, row * self.width + col, -1)


def parquet_bounds(paths: Sequence[str | Path]) -> tuple[float, float, float, float] | None:
    """The union of the GeoParquet files' ``bbox`` metadata (their primary column's); None when every file is
    empty."""
    boxes = []
    for path in paths:
        geo = json.loads(pq.read_schema(path).metadata[b"geo"])
        bbox = geo["columns"][geo["primary_column"]].get("bbox")
        if bbox and pq.ParquetFile(path).metadata.num_rows:
            boxes.append(bbox[:4] if len(bbox) == 4 else [bbox[0], bbox[1], bbox[3], bbox[4]])
    if not boxes:
        return None
    array = np.asarray(boxes, dtype=np.float64)
    return float(array[:, 0].min()), float(array[:, 1].min()), float(array[:, 2].max()), float(array[:, 3].max())


def object_centres(path: str | Path, batch_rows: int = 65_536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The centres of a GeoParquet file's objects' bounding boxes, one record batch at a time: from its ``bbox``
    covering column, else its geometries' bounds."""
    parquet = pq.ParquetFile(path)
    covered = "bbox" in parquet.schema_arrow.names
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=["bbox" if covered else "geometry"]):
        if covered:
            bbox = batch.column(0)
            xmin, ymin, xmax, ymax = (
                bbox.field(k).to_numpy(zero_copy_only=False) for k in ("xmin", "ymin", "xmax", "ymax")
            )
        else:
            xmin, ymin, xmax, ymax = shapely.bounds(shapely.from_wkb(batch.column(0).to_numpy(zero_copy_only=False))).T
        yield (xmin + xmax) / 2, (ymin + ymax) / 2


def grid_cell(cell_m: float, crs: str) -> float:
    """A cell of ``cell_m`` metres in the CRS's units: a projected CRS's (metres, feet, ...), or the degrees of
    latitude of ``cell_m`` in a geographic CRS (cells square in degrees: narrower in metres away from the equator,
    their areas computed by :func:`cell_areas_ha`)."""
    from pyproj import CRS

    parsed = CRS.from_user_input(crs)
    if parsed.is_geographic:
        return cell_m / math.radians(EARTH_RADIUS_M)
    return cell_m / parsed.axis_info[0].unit_conversion_factor


def cell_areas_ha(grid: CellGrid, crs: str) -> np.ndarray:
    """Each row's cell area in hectares, as a column (height, 1): the square of the cell in metres in a projected
    CRS; on the sphere, between the row's parallels, in a geographic one."""
    from pyproj import CRS

    parsed = CRS.from_user_input(crs)
    if not parsed.is_geographic:
        side = grid.cell * parsed.axis_info[0].unit_conversion_factor
        return np.full((grid.height, 1), side * side / HECTARE)
    north = np.clip(grid.north - grid.cell * np.arange(grid.height), -90.0, 90.0)
    south = np.clip(north - grid.cell, -90.0, 90.0)
    band = np.abs(np.sin(np.radians(north)) - np.sin(np.radians(south)))
    return (EARTH_RADIUS_M**2 * math.radians(grid.cell) * band / HECTARE)[:, np.newaxis]


def object_density(paths: Sequence[str | Path], cell: float, crs: str) -> tuple[np.ndarray, CellGrid | None]:
    """Objects per hectare a cell (``cell`` in the CRS's units, :func:`grid_cell`) over the GeoParquet files (their
    objects' centres), float32, and its grid; ``(empty, None)`` when the files hold no object."""
    bounds = parquet_bounds(paths)
    if bounds is None:
        return np.zeros((0, 0), np.float32), None
    grid = CellGrid.covering(bounds, cell)
    counts = np.zeros(grid.width * grid.height, dtype=np.int64)
    for path in paths:
        for x, y in object_centres(path):
            index = grid.cells_of(x, y)
            counts += np.bincount(index[index >= 0], minlength=counts.size)
    density = counts.reshape(grid.height, grid.width) / cell_areas_ha(grid, crs)
    return density.astype(np.float32)[np.newaxis], grid


def raster_means(path: str | Path, cell: float, classes: int | None, samples: int = 10) -> tuple[np.ndarray, CellGrid]:
    """A raster's (the project's mosaic's) summary on a grid of ``cell``: with ``classes``, each class's share of a
    cell's points with data (one band per class id 0..classes-1); else each band's mean. Read through a WarpedVRT of
    ``samples`` points a cell edge (nearest for classes, average for values), a strip of cells at a time."""
    import rasterio
    from affine import Affine
    from rasterio.enums import Resampling
    from rasterio.vrt import WarpedVRT
    from rasterio.windows import Window

    with rasterio.open(path) as src:
        grid = CellGrid.covering(tuple(src.bounds), cell)
        k = max(1, min(samples, round(cell / abs(src.transform.a))))
        resampling = Resampling.nearest if classes is not None else Resampling.average
        bands = classes if classes is not None else src.count
        out = np.full((bands, grid.height, grid.width), NODATA, dtype=np.float32)
        sample = grid.transform @ Affine.scale(1 / k)
        with WarpedVRT(
            src, crs=src.crs, transform=sample, width=grid.width * k, height=grid.height * k, resampling=resampling
        ) as vrt:
            for top in range(0, grid.height, STRIP_CELLS):
                rows = min(STRIP_CELLS, grid.height - top)
                data = vrt.read(window=Window(0, top * k, grid.width * k, rows * k), masked=True)
                out[:, top : top + rows] = _cell_means(data, k, classes)
    return out, grid


def _cell_means(data: np.ma.MaskedArray, k: int, classes: int | None) -> np.ndarray:
    """A strip's (bands, rows·k, cols·k) points to its cells' means (or class shares), NODATA where no point has
    data."""
    bands, height, width = data.shape
    valid = ~np.ma.getmaskarray(data)
    blocks = (height // k, k, width // k, k)
    seen = valid[0].reshape(blocks).sum(axis=(1, 3))
    if classes is not None:
        values = np.ma.getdata(data[0])
        sums = np.stack([((values == c) & valid[0]).reshape(blocks).sum(axis=(1, 3)) for c in range(classes)])
        shares = sums / np.maximum(seen, 1)
        return np.where(seen > 0, shares, NODATA)
    filled = np.where(valid, np.ma.getdata(data).astype(np.float64), 0.0)
    sums = filled.reshape(bands, *blocks).sum(axis=(2, 4))
    count = valid.reshape(bands, *blocks).sum(axis=(2, 4))
    return np.where(count > 0, sums / np.maximum(count, 1), NODATA)


def write_summary(data: np.ndarray, grid: CellGrid, crs: str, path: str | Path, names: Sequence[str]) -> None:
    """Write a summary (bands, rows, cols) as a deflate COG with overviews, its bands described by ``names``,
    atomically."""
    import rasterio
    from rasterio.io import MemoryFile
    from rasterio.shutil import copy

    profile = {
        "driver": "GTiff",
        "dtype": "float32",
        "count": data.shape[0],
        "width": grid.width,
        "height": grid.height,
        "crs": crs,
        "transform": grid.transform,
        "nodata": NODATA,
    }
    with MemoryFile() as memory, memory.open(**profile) as dataset:
        dataset.write(data.astype(np.float32))
        for index, name in enumerate(names, start=1):
            dataset.set_band_description(index, name)
        with atomic_path(path) as tmp, rasterio.Env(GDAL_NUM_THREADS="2"):
            copy(dataset, str(tmp), driver="COG", compress="DEFLATE", blocksize=512, overview_resampling="average")


def summarize_layer(kind: str, layers: Sequence[str], cell_m: float, crs: str, labels: Sequence[str], out: str) -> str:
    """Write the summary raster of a project's layer (``kind``: ``objects``, ``classes`` or ``values``, as
    :class:`rasterscale.tasks.spec.TaskSpec`'s ``project_summary``) in cells of ``cell_m`` metres; a line for the
    log."""
    cell = grid_cell(cell_m, crs)
    if kind == "objects":
        data, grid = object_density(layers, cell, crs)
        if grid is None:  # no object at all: one cell of 0 where the layer would be
            grid, data = CellGrid(0.0, cell, cell, 1, 1), np.zeros((1, 1, 1), np.float32)
        names = ["objects per ha"]
    else:
        data, grid = raster_means(layers[0], cell, len(labels) if kind == "classes" else None)
        names = [f"{label} cover" if kind == "classes" else f"mean {label}" for label in labels][: data.shape[0]]
    write_summary(data, grid, crs, out, names)
    size = f"{cell_m:g} m" + (f" ({cell:.6g} in the CRS's units)" if cell != cell_m else "")
    return f"{out}: {kind}, {grid.width} x {grid.height} cells of {size} from {len(layers)} file(s)"
