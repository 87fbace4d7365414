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
    once (an STRtree over every area)."""
    names = sorted(areas)
    geometries = np.array([areas[name] for name in names], dtype=object)
    near: dict[str, set[str]] = {name: set() for name in names}
    if not names:
        return near
    left, right = STRtree(geometries).query(geometries, predicate="dwithin", distance=tolerance)
    for i, j in zip(left.tolist(), right.tolist(), strict=True):
        if i != j:
            near[names[i]].add(names[j])
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
