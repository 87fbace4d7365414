"""The points layer's rows (torch-free): a rank file's and a scene's columns, the frame of decoded points in the
raster's CRS, and the core rule that keeps each tile's points where its core holds them (the dense tasks' cores:
:func:`~rasterscale.tasks.blending.tile_cores`), so that the tiles of a scene give each place's point once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def in_cores(points: np.ndarray, tiles: Sequence[Tile], cores: Mapping[int, Window]) -> np.ndarray:
    """(B, N, 4) decoded points of a batch of tiles (each tile's pixels; a row of score 0 is none) -> (m, 5) rows
    in the raster's pixels (pixel centres) of those whose pixel lies in their tile's core, with the tile's id: the
    whole batch in one pass."""
    offsets = np.array([(tile.col_off, tile.row_off, tile.tile_id) for tile in tiles], dtype=np.float64)
    windows = [cores[tile.tile_id] for tile in tiles]
    bounds = np.array([(w.col_off, w.row_off, w.col_off + w.width, w.row_off + w.height) for w in windows], np.float64)
    px = points[..., 0] + offsets[:, None, 0] + 0.5
    py = points[..., 1] + offsets[:, None, 1] + 0.5
    keep = (points[..., 2] > 0) & (px >= bounds[:, None, 0]) & (px < bounds[:, None, 2])
    keep &= (py >= bounds[:, None, 1]) & (py < bounds[:, None, 3])
    batch, _ = np.nonzero(keep)
    return np.column_stack([px[keep], py[keep], points[..., 2][keep], points[..., 3][keep], offsets[batch, 2]])
