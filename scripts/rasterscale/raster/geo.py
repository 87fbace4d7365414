"""Between raster pixel space and the raster's CRS.

Boxes are ``(N, 4)`` arrays of ``xmin, ymin, xmax, ymax`` in pixel units (x = column, y = row) of the whole
raster. Footprints in the CRS are polygons of the four transformed corners, exact for any affine transform
(rotated rasters included).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import shapely
from affine import Affine


def pixel_boxes_to_polygons(boxes: np.ndarray, transform: Affine) -> np.ndarray:
    """Polygons in the CRS of pixel boxes under ``transform``."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    x0, y0, x1, y1 = boxes.T
    cols = np.stack([x0, x1, x1, x0, x0], axis=1)
    rows = np.stack([y0, y0, y1, y1, y0], axis=1)
    a, b, c, d, e, f = transform.a, transform.b, transform.c, transform.d, transform.e, transform.f
    xs = a * cols + b * rows + c
    ys = d * cols + e * rows + f
    return shapely.polygons(np.stack([xs, ys], axis=2))


def geometries_to_pixel_boxes(geometries: np.ndarray, transform: Affine) -> np.ndarray:
    """Pixel-space bounding boxes of geometries given in the raster's CRS."""
    geometries = np.asarray(geometries)
    if len(geometries) == 0:
        return np.zeros((0, 4))
    coords, index = shapely.get_coordinates(geometries, return_index=True)
    inverse = ~transform
    cols = inverse.a * coords[:, 0] + inverse.b * coords[:, 1] + inverse.c
    rows = inverse.d * coords[:, 0] + inverse.e * coords[:, 1] + inverse.f
    boxes = np.empty((len(geometries), 4))
    for k, (values, reducer) in enumerate(
        [(cols, np.minimum), (rows, np.minimum), (cols, np.maximum), (rows, np.maximum)]
    ):
        start = np.full(len(geometries), np.inf if reducer is np.minimum else -np.inf)
        reducer.at(start, index, values)
        boxes[:, k] = start
    return boxes


def box_areas(boxes: np.ndarray) -> np.ndarray:
    boxes = np.asarray(boxes).reshape(-1, 4)
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)


def box_pairs(boxes_a: np.ndarray, boxes_b: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j) of boxes that intersect (strictly, positive area), found with an STRtree.

    With one array, each unordered pair i < j is returned once.
    """
    boxes_a = np.asarray(boxes_a, dtype=np.float64).reshape(-1, 4)
    same = boxes_b is None
    boxes_b = boxes_a if same else np.asarray(boxes_b, dtype=np.float64).reshape(-1, 4)
    if len(boxes_a) == 0 or len(boxes_b) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    tree = shapely.STRtree(shapely.box(*boxes_b.T))
    i, j = tree.query(shapely.box(*boxes_a.T), predicate="intersects")
    inter = intersection_areas(boxes_a[i], boxes_b[j])
    keep = inter > 0
    if same:
        keep &= i < j
    return i[keep], j[keep]


def intersection_areas(boxes_a: np.ndarray, boxes_b: np.ndarray) -> np.ndarray:
    """Element-wise intersection area of two equally long box arrays."""
    width = np.minimum(boxes_a[:, 2], boxes_b[:, 2]) - np.maximum(boxes_a[:, 0], boxes_b[:, 0])
    height = np.minimum(boxes_a[:, 3], boxes_b[:, 3]) - np.maximum(boxes_a[:, 1], boxes_b[:, 1])
    return np.clip(width, 0, None) * np.clip(height, 0, None)


def pair_ious(boxes_a: np.ndarray, boxes_b: np.ndarray) -> np.ndarray:
    """Element-wise IoU of two equally long box arrays."""
    inter = intersection_areas(boxes_a, boxes_b)
    union = box_areas(boxes_a) + box_areas(boxes_b) - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


class GeometryIndex:
    """An STRtree over geometries, built on first use and left out of a pickle (a dataset goes to dataloader worker
    processes, each builds its own)."""

    def __init__(self, geometries: np.ndarray) -> None:
        self.geometries = geometries
        self._tree: shapely.STRtree | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tree": None}

    @property
    def built(self) -> bool:
        return self._tree is not None

    def query(self, geometry: Any, predicate: str | None = None) -> np.ndarray:
        """The sorted indexes of the geometries whose extents meet ``geometry``'s (and ``predicate``, when given)."""
        if self._tree is None:
            self._tree = shapely.STRtree(self.geometries)
        return np.sort(self._tree.query(geometry, predicate=predicate))
