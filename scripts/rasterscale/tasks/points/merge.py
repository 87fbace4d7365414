"""A scene's rank files of points into its layer (torch-free): every tile gave the points its core holds
(:mod:`.rankoutput`), so a place's point comes once; what is left is a peak found by two tiles a pixel either side
of their cores' edge, or twice on a plateau, and points on masked pixels. Points of one class closer than
``merge.point_distance`` are one: the best scoring is kept (:func:`one_per_place`), and points on no data go. Also a
merged layer's counts by class."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
from scipy.spatial import cKDTree

from rasterscale.atomic import write_geoparquet, write_gpkg
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import read_spec, valid_at
from rasterscale.tasks.detectors.merge import greedy_nms, read_rank_files
from rasterscale.tasks.points.layer import POINT_COLUMNS, empty_points

LAYER = "points"  # the GeoPackage's layer


def close_pairs(xy: np.ndarray, distance: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (i, j), i < j, of points (n x 2) closer than ``distance`` (a KD-tree's, never all pairs)."""
    if len(xy) < 2:
        return np.array([], dtype=np.int64), np.array([], dtype=np.int64)
    pairs = cKDTree(xy).query_pairs(np.nextafter(distance, 0), output_type="ndarray")
    return pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)


def one_per_place(
    xy: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray,
    distance: float,
    apart: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Keep-mask: greedy NMS by score over the pairs of points of one class closer than ``distance`` (and, with
    ``apart``, a function of the candidate pairs' (i, j) giving a boolean per pair, only those where it is true)."""
    i, j = close_pairs(xy, distance)
    same = labels[i] == labels[j]
    if apart is not None:
        same &= apart(i, j)
    return greedy_nms(scores, i[same], j[same])


def merge_scene(
    rank_files: Sequence[str | Path],
    manifest_path: str | Path,
    raster_path: str | Path,
    gpkg_path: str | Path,
    parquet_path: str | Path,
    distance: float,
) -> gpd.GeoDataFrame:
    """A scene's rank files (their records already checked: :mod:`rasterscale.jobs.rankfiles`) as one layer of
    points on valid pixels, one per place within ``distance`` (the raster's CRS units), sorted by score, written
    as GeoParquet and GeoPackage (atomically); its rows."""
    raster = check_raster(raster_path)
    points = read_rank_files(rank_files, empty_points)
    if points.crs is None:
        points = points.set_crs(raster.crs)
    spec = read_spec(manifest_path)
    if len(points) and spec.mask != "none":
        points = points[valid_at(raster_path, spec, points["px_x"].to_numpy(), points["px_y"].to_numpy())]
    rows = one_per_place_layer(points, (abs(raster.transform.a) + abs(raster.transform.e)) / 2, distance)
    write_geoparquet(rows, parquet_path)
    write_gpkg(rows, gpkg_path, layer=LAYER)
    return rows


def one_per_place_layer(points: gpd.GeoDataFrame, pixel_size: float, distance: float) -> gpd.GeoDataFrame:
    """A scene's points (:data:`POINT_COLUMNS`, pixels of ``pixel_size`` CRS units) one per place within
    ``distance`` (:func:`one_per_place`), sorted by score (the best first)."""
    if len(points):
        xy = points[["px_x", "px_y"]].to_numpy(dtype=np.float64)
        labels = pd.factorize(points["label"])[0]
        scores = points["score"].to_numpy(dtype=np.float64)
        points = points[one_per_place(xy, scores, labels, distance / pixel_size)]
    rows = points.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)[POINT_COLUMNS]
    return gpd.GeoDataFrame(rows, geometry="geometry", crs=points.crs)
