"""Crown masks to polygons, and the rank files that hold them (torch-free: the merge reads them).

A predicted mask (one instance of a tile, at the tile's pixels or a crop of them from its origin, as the batched
Mask R-CNN gives it) becomes ONE polygon: the largest 4-connected part of the thresholded mask, holes kept, traced
along pixel edges (:func:`rasterio.features.shapes`, on the crop of the mask to its extent), its corners cut
(:func:`cut_corners`: a staircase becomes the slope it steps along) and simplified within half a pixel
(Douglas-Peucker, topology preserved), in the raster's pixel coordinates (x = column, y = row; the tile's offset
added). Its area is the mask's pixel count within a fraction of a pixel per unit of outline; its perimeter is the
crown's, not a staircase's (4/pi of it along a circle). An instance is *cut* when its mask reaches an edge of its
tile that is not the raster's edge (the crown may go on in the neighbouring tile).

A rank file is GeoParquet, one row per instance: ``tile_id``, ``label`` (class name), ``score``, ``cut``, the pixel
box of the polygon (``px_xmin`` .. ``px_ymax``, raster pixels) and ``geometry``, the polygon in the raster's CRS
(the affine transform of the pixel polygon). The merge needs no pixel polygon: IoU and containment are ratios of
areas, which an affine transform scales alike, so those of the CRS polygons are the pixel polygons' own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd
import shapely
from affine import Affine
from rasterio.features import shapes

from rasterscale.grid.tile import Tile
from rasterscale.tasks.detectors.merge import BOX_COLUMNS, write_objects_file

SIMPLIFY_PX = 0.5  # Douglas-Peucker tolerance after the corners are cut (those move the outline by 0.36 px at most)
INSTANCE_COLUMNS = ["tile_id", "label", "score", "cut", *BOX_COLUMNS, "geometry"]
BYTES_PER_VERTEX = 16  # a polygon's vertex, held by GEOS (what a rank output holds per instance, about)
BYTES_PER_INSTANCE = 200  # its polygon's and row's overhead
OVERLAP_CHUNK = 16_384  # pairs of polygons intersected at once


@dataclass
class TileInstances:
    """A tile's instances: polygons in the raster's pixel coordinates, scores, 0-based labels, cut or not."""

    tile_id: int
    polygons: np.ndarray  # shapely Polygons
    scores: np.ndarray
    labels: np.ndarray
    cut: np.ndarray

    def nbytes(self) -> int:
        """About what its polygons hold in memory."""
        vertices = int(shapely.get_num_coordinates(self.polygons).sum()) if len(self.polygons) else 0
        return vertices * BYTES_PER_VERTEX + len(self.polygons) * BYTES_PER_INSTANCE


def mask_polygon(mask: np.ndarray, col_off: float = 0, row_off: float = 0) -> shapely.Polygon | None:
    """The largest 4-connected part of a boolean mask as a polygon along its pixels' edges (holes kept), at
    ``(col_off, row_off)`` in pixel coordinates; None for an empty mask. Traced on the crop of the mask to its
    extent (a crown is a small part of its tile)."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if not len(rows):
        return None
    r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    crop = np.ascontiguousarray(mask[r0:r1, c0:c1], dtype=np.uint8)
    offset = Affine.translation(col_off + c0, row_off + r0)
    traced = shapes(crop, mask=crop.astype(bool), connectivity=4, transform=offset)
    parts = [shapely.geometry.shape(geometry) for geometry, _ in traced]
    return max(parts, key=lambda part: part.area)


def cut_corners(polygons: np.ndarray) -> np.ndarray:
    """Polygons traced along pixel edges with every ring through the midpoints of its unit edges instead: each
    corner cut by a diagonal, within 0.36 px of the outline; a convex corner loses 1/8 px², a concave one gains
    as much (a crown loses half a pixel in all). The polygons that would come out invalid are left as they are."""
    polygons = np.asarray(polygons, dtype=object)
    if not len(polygons):
        return polygons
    rings, owner = shapely.get_rings(shapely.segmentize(polygons, 1.0), return_index=True)
    coords, ring = shapely.get_coordinates(rings, return_index=True)  # closed rings: the last point is the first
    same = ring[1:] == ring[:-1]
    midpoints = (coords[1:][same] + coords[:-1][same]) / 2
    cut = shapely.polygons(shapely.linearrings(midpoints, indices=ring[1:][same]), indices=owner)
    return np.where(shapely.is_valid(cut), cut, polygons)


def binary_masks(masks: np.ndarray, tile: Tile, mask_threshold: float, origins: np.ndarray) -> list[np.ndarray]:
    """Each instance's boolean mask, ``masks > mask_threshold`` (0/1 or bool masks, and [0, 1] probabilities, at
    0.5; a (N, 1, H, W) model output squeezed), cut to the tile's pixels: the crop of the tile from the instance's
    origin (``origins`` (N, 2): column, row; zeros where every mask is the whole tile's)."""
    masks = np.asarray(masks)
    if masks.ndim == 4:
        masks = masks[:, 0]
    return [
        mask[: tile.height - row, : tile.width - column] > mask_threshold
        for mask, (column, row) in zip(masks, np.asarray(origins).tolist(), strict=True)
    ]


def touches_inner_edge(
    binary: Sequence[np.ndarray], origins: np.ndarray, tile: Tile, raster_width: int, raster_height: int
) -> np.ndarray:
    """For each instance's boolean crop of a tile (from its origin, column and row; :func:`binary_masks`): True
    when it has a pixel on an edge of the tile that is not the raster's."""
    inner = (tile.col_off > 0, tile.col_off + tile.width < raster_width)  # left, right
    inner_rows = (tile.row_off > 0, tile.row_off + tile.height < raster_height)  # top, bottom
    touches = []
    for mask, (column, row) in zip(binary, np.asarray(origins).tolist(), strict=True):
        height, width = mask.shape
        touches.append(
            bool(width and height)
            and (
                (inner[0] and column == 0 and bool(mask[:, 0].any()))
                or (inner[1] and column + width == tile.width and bool(mask[:, -1].any()))
                or (inner_rows[0] and row == 0 and bool(mask[0].any()))
                or (inner_rows[1] and row + height == tile.height and bool(mask[-1].any()))
            )
        )
    return np.array(touches, dtype=bool)


def tile_instances(
    masks: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray,
    tile: Tile,
    raster_width: int,
    raster_height: int,
    mask_threshold: float = 0.5,
    origins: np.ndarray | None = None,
) -> TileInstances:
    """A tile's predicted masks (N, H, W) (bool, 0/1, or probabilities: kept above ``mask_threshold``), each the
    crop of the tile from its origin (``origins`` (N, 2): column, row; None: at the tile's pixels), as one polygon
    each (see the module docstring), in the raster's pixel coordinates; instances whose mask is empty are
    dropped."""
    origins = np.zeros((len(masks), 2), dtype=np.int64) if origins is None else np.asarray(origins)
    binary = binary_masks(masks, tile, mask_threshold, origins)
    polygons = [
        mask_polygon(mask, tile.col_off + column, tile.row_off + row)
        for mask, (column, row) in zip(binary, origins.tolist(), strict=True)
    ]
    present = np.array([polygon is not None for polygon in polygons], dtype=bool)
    found = np.array([polygon for polygon in polygons if polygon is not None], dtype=object)
    return TileInstances(
        tile.tile_id,
        shapely.simplify(cut_corners(found), SIMPLIFY_PX, preserve_topology=True) if len(found) else found,
        np.asarray(scores, dtype=np.float32).reshape(-1)[present],
        np.asarray(labels, dtype=np.int64).reshape(-1)[present],
        touches_inner_edge(binary, origins, tile, raster_width, raster_height)[present],
    )


def to_crs(polygons: np.ndarray, transform: Affine) -> np.ndarray:
    """Pixel-coordinate geometries in the raster's CRS (its affine transform)."""
    return _affine(polygons, transform)


def to_pixels(geometries: np.ndarray, transform: Affine) -> np.ndarray:
    """CRS geometries in the raster's pixel coordinates (the inverse of its affine transform)."""
    return _affine(geometries, ~transform)


def _affine(geometries: np.ndarray, transform: Affine) -> np.ndarray:
    a, b, c, d, e, f = transform.a, transform.b, transform.c, transform.d, transform.e, transform.f

    def apply(xy: np.ndarray) -> np.ndarray:
        x, y = xy[:, 0], xy[:, 1]
        return np.stack([a * x + b * y + c, d * x + e * y + f], axis=1)

    return shapely.transform(np.asarray(geometries, dtype=object), apply)


def empty_instances(crs: object) -> gpd.GeoDataFrame:
    frame = pd.DataFrame(
        {
            "tile_id": pd.Series(dtype="int64"),
            "label": pd.Series(dtype="str"),
            "score": pd.Series(dtype="float32"),
            "cut": pd.Series(dtype="bool"),
            **{column: pd.Series(dtype="float64") for column in BOX_COLUMNS},
        }
    )
    return gpd.GeoDataFrame(frame, geometry=gpd.GeoSeries([], crs=crs), crs=crs)


def instances_frame(
    tiles: Sequence[TileInstances], labels: Sequence[str], transform: Affine, crs: Any
) -> gpd.GeoDataFrame:
    """Tiles' instances as rank-file rows (:data:`INSTANCE_COLUMNS`): pixel boxes, CRS polygons, class names."""
    rows = [t for t in tiles if len(t.polygons)]
    if not rows:
        return empty_instances(crs)
    polygons = np.concatenate([t.polygons for t in rows])
    boxes = shapely.bounds(polygons)
    frame = pd.DataFrame(
        {
            "tile_id": np.concatenate([np.full(len(t.polygons), t.tile_id, dtype=np.int64) for t in rows]),
            "label": np.asarray(labels, dtype=object)[np.concatenate([t.labels for t in rows])],
            "score": np.concatenate([t.scores for t in rows]).astype(np.float32),
            "cut": np.concatenate([t.cut for t in rows]),
            **{column: boxes[:, k] for k, column in enumerate(BOX_COLUMNS)},
        }
    )
    return gpd.GeoDataFrame(frame, geometry=to_crs(polygons, transform), crs=crs)


def write_instances_file(instances: gpd.GeoDataFrame, path: str | Path) -> None:
    """GeoParquet of instances in the rank file's columns, atomically."""
    write_objects_file(instances, INSTANCE_COLUMNS, path)


def polygon_pairs(geometries_a: np.ndarray, geometries_b: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j) of geometries whose envelopes intersect, found with an STRtree (the candidates of any
    overlap); with one array, each unordered pair i < j once."""
    geometries_a = np.asarray(geometries_a, dtype=object)
    same = geometries_b is None
    geometries_b = geometries_a if geometries_b is None else np.asarray(geometries_b, dtype=object)
    if len(geometries_a) == 0 or len(geometries_b) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    i, j = shapely.STRtree(geometries_b).query(geometries_a)
    if same:
        keep = i < j
        i, j = i[keep], j[keep]
    return i.astype(np.int64), j.astype(np.int64)


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def overlap_areas(geometries_a: np.ndarray, geometries_b: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Element-wise intersection area of two equally long geometry arrays: :data:`OVERLAP_CHUNK` pairs at a time
    (each chunk's intersections are let go once measured), over ``threads`` threads (GEOS runs without the GIL;
    default: the cores this process may use)."""
    geometries_a, geometries_b = np.asarray(geometries_a, dtype=object), np.asarray(geometries_b, dtype=object)

    def chunk(start: int) -> np.ndarray:
        part = slice(start, start + OVERLAP_CHUNK)
        return np.asarray(shapely.area(shapely.intersection(geometries_a[part], geometries_b[part])), dtype=np.float64)

    starts = range(0, len(geometries_a), OVERLAP_CHUNK)
    if len(starts) <= 1:
        return chunk(0) if len(geometries_a) else np.zeros(0)
    with ThreadPoolExecutor(threads or usable_cores()) as pool:
        return np.concatenate(list(pool.map(chunk, starts)))


def ious_of(intersections: np.ndarray, areas_a: np.ndarray, areas_b: np.ndarray) -> np.ndarray:
    """IoU from intersection areas and both areas (0 where the union is empty)."""
    union = areas_a + areas_b - intersections
    return np.divide(intersections, union, out=np.zeros_like(intersections, dtype=np.float64), where=union > 0)
