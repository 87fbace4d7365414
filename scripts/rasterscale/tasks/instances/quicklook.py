"""A downsampled picture of a scene with predicted crowns (red) and ground-truth crowns (cyan) outlined
(:mod:`rasterscale.tasks.detectors.quicklook`)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import shapely

from rasterscale.tasks.detectors.quicklook import render_quicklook
from rasterscale.tasks.instances.polygons import to_pixels


def polygon_outlines(polygons: np.ndarray) -> list[np.ndarray]:
    """Every ring (exteriors and holes) of polygons in pixel coordinates, as (K, 2) arrays."""
    polygons = np.asarray(polygons, dtype=object).reshape(-1)
    if not len(polygons):
        return []
    rings = np.concatenate([shapely.get_exterior_ring(polygons), *holes_of(polygons)])
    coords, index = shapely.get_coordinates(rings, return_index=True)
    return np.split(coords, np.flatnonzero(np.diff(index)) + 1)


def holes_of(polygons: np.ndarray) -> list[np.ndarray]:
    counts = shapely.get_num_interior_rings(polygons)
    return [shapely.get_interior_ring(polygons[counts > k], k) for k in range(int(counts.max(initial=0)))]


# (raster, predicted polygons, true polygons or None, png, max_side=1600, title=""): polygons in raster pixels outlined
render_instances_quicklook = partial(render_quicklook, outlines=polygon_outlines)


def scored_crowns(path: str | Path, transform: Any, min_score: float) -> np.ndarray:
    """A layer's crowns scoring at least ``min_score``, as polygons in the raster's pixels (``transform``: the
    raster's)."""
    import geopandas as gpd

    crowns = gpd.read_parquet(path, columns=["score", "geometry"])
    kept = crowns["score"].to_numpy() >= min_score
    return to_pixels(np.asarray(crowns.geometry.array, dtype=object)[kept], transform)
