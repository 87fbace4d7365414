"""The points layer's rows (torch-free): a rank file's and a scene's columns, the frame of decoded points in the
raster's CRS, and the core rule that keeps each tile's points where its core holds them (the dense tasks' cores:
:func:`~rasterscale.tasks.blending.tile_cores`), so that the tiles of a scene give each place's point once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import geopandas as gpd
import numpy as np
import shapely
from rasterio.windows import Window

from rasterscale.grid.tile import Tile

# a rank file's and a scene layer's columns: the point's class and score, its pixel (column, row) in the raster
# (a pixel's centre at +0.5), the tile it came from, and the point in the raster's CRS
POINT_COLUMNS = ["label", "score", "px_x", "px_y", "tile_id", "geometry"]


def empty_points(crs: Any) -> gpd.GeoDataFrame:
    """The frame of no points, in ``crs``."""
    return gpd.GeoDataFrame(
        {
            "label": np.array([], dtype=object),
            "score": np.array([], dtype=np.float64),
            "px_x": np.array([], dtype=np.float64),
            "px_y": np.array([], dtype=np.float64),
            "tile_id": np.array([], dtype=np.int64),
        },
        geometry=gpd.GeoSeries([], crs=crs),
        crs=crs,
    )


def points_frame(rows: np.ndarray, labels: Sequence[str], transform: Any, crs: Any) -> gpd.GeoDataFrame:
    """(N, 5) rows (px_x, px_y, score, class index, tile_id) as a frame of :data:`POINT_COLUMNS` in ``crs``."""
    if not len(rows):
        return empty_points(crs)
    px, py = rows[:, 0], rows[:, 1]
    x = transform.c + transform.a * px + transform.b * py
    y = transform.f + transform.d * px + transform.e * py
    names = np.asarray(list(labels), dtype=object)[rows[:, 3].astype(np.int64)]
    return gpd.GeoDataFrame(
        {
            "label": names,
            "score": rows[:, 2].astype(np.float64),
            "px_x": px,
            "px_y": py,
            "tile_id": rows[:, 4].astype(np.int64),
        },
        geometry=shapely.points(x, y),
        crs=crs,
    )


def in_core(points: np.ndarray, tile: Tile, core: Window) -> np.ndarray:
    """(n, 4) decoded points of a tile (its pixels) -> (m, 5) rows in the raster's pixels (pixel centres) of those
    scoring above 0 whose pixel lies in the tile's ``core``, with the tile's id."""
    found = points[points[:, 2] > 0]
    px, py = found[:, 0] + tile.col_off + 0.5, found[:, 1] + tile.row_off + 0.5
    col0, row0 = core.col_off, core.row_off
    keep = (px >= col0) & (px < col0 + core.width) & (py >= row0) & (py < row0 + core.height)
    ids = np.full(int(keep.sum()), tile.tile_id, dtype=np.float64)
    return np.column_stack([px[keep], py[keep], found[keep, 2], found[keep, 3], ids])
