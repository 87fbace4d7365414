"""A large project's layer as partitions: one GeoParquet file a batch (:mod:`rasterscale.workflow.batches`: batches
stay put as scenes are added), each holding the objects its batch's sources (scenes and seams) own.

A partition is made from its batch's sources' objects *and* those of their neighbours (the sources whose areas
meet theirs, ring 1): ownership (:class:`rasterscale.grid.project.Ownership`) and the removal of duplicates where
two owners meet need both sides of every border. The neighbours' own ownership needs the areas of *their*
neighbours (ring 2), not their objects. So a partition changes only when a source of ring 0, 1 or 2 changes, and
adding scenes rewrites the partitions of their batches and of the batches beside them, no other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import shapely
from shapely import STRtree


@dataclass(frozen=True)
class Neighbourhood:
    """A partition's sources: those it keeps the objects of (``owners``), those whose objects it reads beside them
    (``neighbours``, ring 1) and those whose areas it needs (``outer``, ring 2), each by name, sorted."""

    owners: tuple[str, ...]
    neighbours: tuple[str, ...]
    outer: tuple[str, ...]


def adjacency(areas: Mapping[str, shapely.Geometry], tolerance: float = 0.0) -> dict[str, set[str]]:
    """Which sources' areas meet (or come within ``tolerance`` of) each source's, itself left out; all pairs at
    once (:func:`_adjacent_pairs`)."""
    names, left, right = _adjacent_pairs(areas, tolerance)
    order = np.argsort(left, kind="stable")
    left, found = left[order], np.array(names, dtype=object)[right[order]].tolist()
    starts = np.flatnonzero(np.r_[True, left[1:] != left[:-1]][: len(left)])
    ends = [*starts.tolist(), len(found)]
    near: dict[str, set[str]] = {name: set() for name in names}
    for index, start, end in zip(left[starts].tolist(), ends[:-1], ends[1:], strict=True):
        near[names[index]] = set(found[start:end])
    return near


def area_neighbourhoods(
    groups: Mapping[int, Sequence[str]], areas: Mapping[str, shapely.Geometry], tolerance: float = 0.0
) -> dict[int, Neighbourhood]:
    """:func:`neighbourhoods` of the sources' :func:`adjacency`, from the meeting pairs' indexes (no set of each
    source's neighbours)."""
    names, left, right = _adjacent_pairs(areas, tolerance)
    order = np.argsort(left, kind="stable")
    starts, neighbours = np.searchsorted(left[order], np.arange(len(names) + 1)), right[order]
    index = {name: k for k, name in enumerate(names)}
    named = np.array(names, dtype=object)
    found = {}
    for group, members in groups.items():
        owners = np.fromiter((index[name] for name in members if name in index), dtype=np.intp)
        ring1 = _around(owners, starts, neighbours, owners)
        ring2 = _around(ring1, starts, neighbours, ring1, owners)
        rings = tuple(named[ring1].tolist()), tuple(named[ring2].tolist())
        found[group] = Neighbourhood(tuple(sorted(set(members))), *rings)
    return found


def _around(sources: np.ndarray, starts: np.ndarray, neighbours: np.ndarray, *left_out: np.ndarray) -> np.ndarray:
    """The neighbours of these sources (indexes; source s's are ``neighbours[starts[s]:starts[s + 1]]``) but those
    ``left_out``, each once, sorted."""
    first, counts = starts[sources], starts[sources + 1] - starts[sources]
    at = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    ring = np.zeros(len(starts) - 1, dtype=bool)
    ring[neighbours[at]] = True
    for indexes in left_out:
        ring[indexes] = False
    return np.flatnonzero(ring)


def _adjacent_pairs(
    areas: Mapping[str, shapely.Geometry], tolerance: float
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The sources by name, sorted, and the pairs (i, j), i != j, of them whose areas come within ``tolerance``
    of one another (:func:`_within`; an area with no geometry meets none)."""
    names = sorted(areas)
    if not names:
        return names, np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    return names, *_within(np.array([areas[name] for name in names], dtype=object), tolerance)


def _within(geometries: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (i, j), i != j, of geometries within ``tolerance`` of one another, as an STRtree's ``dwithin``
    query of each finds them (GEOS's distance from i, prepared, to j). Where the tolerance is well above the
    coordinates' rounding, pairs that intersect are within either way round (GEOS measures them 0 apart, or a
    rounding error), as are boxes nearer than the tolerance by more than that rounding (:func:`_surely_within`):
    the tree is queried for the other pairs only."""
    tree = STRtree(geometries)
    bounds = shapely.bounds(geometries)
    known = np.isfinite(bounds).all(axis=1)  # not None or empty
    grown = np.full(len(geometries), None, dtype=object)
    grown[known] = shapely.box(*(bounds[known] + 2 * tolerance * np.array([-1.0, -1.0, 1.0, 1.0])).T)
    left, right = tree.query(grown)  # envelopes that meet: every pair within tolerance, and a few more
    keep = left < right
    left, right = left[keep], right[keep]
    meet = np.zeros(len(left), dtype=bool)
    rounding = 1e-12 * (1 + np.abs(bounds[known]).max()) if len(left) else np.inf  # far above GEOS's
    if tolerance > 2 * rounding:
        meet = _surely_within(geometries, bounds, left, right, tolerance - rounding)
    asked = np.unique(np.r_[left[~meet], right[~meet]])
    query, found = tree.query(geometries[asked], predicate="dwithin", distance=tolerance)
    query = asked[query]
    unsure = np.minimum(left, right)[~meet] * len(geometries) + np.maximum(left, right)[~meet]
    kept = (query != found) & np.isin(np.minimum(query, found) * len(geometries) + np.maximum(query, found), unsure)
    return np.r_[left[meet], right[meet], query[kept]], np.r_[right[meet], left[meet], found[kept]]


def _surely_within(
    geometries: np.ndarray, bounds: np.ndarray, left: np.ndarray, right: np.ndarray, distance: float
) -> np.ndarray:
    """Whether the geometries of each pair (left, right) are nearer than ``distance``, for sure: boxes (a box's
    polygon exactly) by their bounds, the others where they intersect (shapely's ``intersects``)."""
    boxes = shapely.get_num_coordinates(geometries) == 5
    boxes[boxes] = shapely.equals_identical(geometries[boxes], shapely.box(*bounds[boxes].T))
    both = boxes[left] & boxes[right]
    near = np.zeros(len(left), dtype=bool)
    gap = np.maximum(bounds[left[both], :2], bounds[right[both], :2]) - np.minimum(
        bounds[left[both], 2:], bounds[right[both], 2:]
    )
    near[both] = np.hypot(*np.maximum(gap, 0).T) < distance
    near[~both] = shapely.intersects(geometries[left[~both]], geometries[right[~both]])
    return near


def neighbourhoods(groups: Mapping[int, Sequence[str]], near: Mapping[str, set[str]]) -> dict[int, Neighbourhood]:
    """Each group's (batch's) :class:`Neighbourhood`, from the sources' :func:`adjacency`. A source with no
    known area (a demo scene not yet made) meets none."""
    found = {}
    for group, members in groups.items():
        owners = set(members)
        ring1 = set().union(*(near.get(name, set()) for name in owners)) - owners
        ring2 = set().union(*(near.get(name, set()) for name in ring1)) - ring1 - owners
        found[group] = Neighbourhood(tuple(sorted(owners)), tuple(sorted(ring1)), tuple(sorted(ring2)))
    return found


def remove_stale(partitions: Sequence[str]) -> list[str]:
    """Remove the files ``batch-*.parquet`` beside a partitioned layer's ``partitions`` that are none of them (a
    batch that no longer holds a project source), so that the folder reads as the layer; the removed files."""
    from pathlib import Path

    listed = {Path(path).resolve() for path in partitions}
    folders = {Path(path).parent for path in partitions}
    stale = [
        path for folder in folders for path in sorted(folder.glob("batch-*.parquet")) if path.resolve() not in listed
    ]
    for path in stale:
        path.unlink(missing_ok=True)
    return [str(path) for path in stale]
