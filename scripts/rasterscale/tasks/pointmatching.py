"""Points compared in metres (torch-free): a raster's square pixel size, and the one-to-one matching of predicted to
true points within a distance that scores the tree tops (:mod:`rasterscale.tasks.regression.treetops`) and the
points task (:mod:`rasterscale.tasks.points.metrics`)."""

from __future__ import annotations

import math

import numpy as np
import rasterio

from rasterscale.errors import InputError
from rasterscale.raster.remote import shown


def square_pixel_size(src: rasterio.io.DatasetReader) -> float:
    """The raster's pixel size in CRS units (metres), which must be square."""
    transform = src.transform
    width, height = math.hypot(transform.a, transform.d), math.hypot(transform.b, transform.e)
    if not math.isclose(width, height, rel_tol=1e-6) or width <= 0:
        raise InputError(
            f"{shown(src.name)}: points are matched in metres: it needs square pixels, got {width} x {height}"
        )
    return width


def match_points(predicted: np.ndarray, truth: np.ndarray, max_distance: float) -> tuple[np.ndarray, np.ndarray]:
    """One-to-one matching of predicted to true points within ``max_distance``: the most pairs, and among those the
    least total distance (an optimal assignment). Candidate pairs come from KD-trees; the assignment is solved per
    connected group of candidates (a handful of points each), so it scales to 100k points. Returns the matched
    (predicted, true) indexes."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    empty = np.array([], dtype=np.int64)
    if len(predicted) == 0 or len(truth) == 0:
        return empty, empty
    pairs = cKDTree(predicted).sparse_distance_matrix(cKDTree(truth), max_distance, output_type="ndarray")
    p, t, d = pairs["i"].astype(np.int64), pairs["j"].astype(np.int64), pairs["v"].astype(np.float64)
    if p.size == 0:  # no true point within max_distance of any prediction
        return empty, empty
    n_pred = len(predicted)
    graph = coo_matrix((np.ones(p.size), (p, t + n_pred)), shape=(n_pred + len(truth),) * 2)
    _, component = connected_components(graph, directed=False)
    group = component[p]
    order = np.argsort(group, kind="stable")
    p, t, d, group = p[order], t[order], d[order], group[order]
    bounds = np.flatnonzero(np.r_[True, group[1:] != group[:-1], True])
    single = np.diff(bounds) == 1  # one candidate pair alone: matched as it is
    matched_p, matched_t = [p[bounds[:-1][single]]], [t[bounds[:-1][single]]]
    for start, stop in zip(bounds[:-1][~single], bounds[1:][~single], strict=True):
        mp, mt = _assign(p[start:stop], t[start:stop], d[start:stop], max_distance)
        matched_p.append(mp)
        matched_t.append(mt)
    return np.concatenate(matched_p), np.concatenate(matched_t)


def _assign(p: np.ndarray, t: np.ndarray, d: np.ndarray, max_distance: float) -> tuple[np.ndarray, np.ndarray]:
    """The optimal assignment within one group of candidate pairs: as many pairs as possible, then the least total
    distance (a candidate pair costs its distance less a bonus larger than any group's total distance)."""
    from scipy.optimize import linear_sum_assignment

    rows, p_index = np.unique(p, return_inverse=True)
    cols, t_index = np.unique(t, return_inverse=True)
    bonus = max_distance * (min(rows.size, cols.size) + 1) + 1.0
    cost = np.zeros((rows.size, cols.size))
    cost[p_index, t_index] = d - bonus
    r, c = linear_sum_assignment(cost)
    paired = cost[r, c] < 0
    return rows[r[paired]], cols[c[paired]]
