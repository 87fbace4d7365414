"""A project: scenes that lie side by side (a survey cut into abutting tiles, or flights that overlap), the seams
between them, and which source owns each place of the project's layer.

A scene is predicted alone: near its edge the model sees only half of an object that goes on in the neighbouring
scene. So every pair of scenes that touch or overlap (same CRS and pixel size) gets a **seam**, predicted like a
scene from a mosaic of the two rasters (:mod:`rasterscale.raster.mosaic`): its tiles read across the border.

- A seam's *line* is where one scene's edge runs inside the other (for abutting scenes, their shared edge); its
  *core* is that line widened by ``margin`` (the tiles' overlap, the largest object's size) on both sides, within
  the two scenes; its tiles are those that meet the core widened once more by ``margin``
  (:func:`tile_region`), so that every object centred in the core lies whole in a tile of the seam.
- Ownership (:class:`Ownership`) keeps each object once: a seam keeps what is centred in its core, and where
  cores cross (near a point where three or more scenes meet) the seam whose two scenes hold the centre deepest
  (farthest from the edge of their union, so that its mosaic holds most of the object; by name on a tie); a
  scene keeps what is centred outside every core and outside every scene of a
  smaller name (two flights over one stand: the first by name keeps their overlap). A scene's object centred
  outside the cores lies at least ``margin`` from its edge, so the scene saw it whole.

Seams are named ``{a}+{b}`` (``a < b``; ``+`` is not allowed in a scene name). Where three or more scenes meet
at a point, a seam's mosaic holds only its two: an object on that very point may be cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import shapely
from shapely import STRtree
from shapely.geometry import Polygon, box

from rasterscale.scene import ProjectSource

SEAM_JOIN = "+"
SNAP = 1e-4  # GEOS's buffer drops a vertex nearer the last than this times the distance (CURVE_VERTEX_SNAP_...)
SAMPLES = 8  # members of a group of translates computed to check that they move alike (its first among them)


@dataclass(frozen=True)
class Footprint:
    """What a project needs of a scene's header: its CRS (as text), bounds, pixel size, bands and data type."""

    crs: str
    bounds: tuple[float, float, float, float]
    pixel: tuple[float, float]  # (width, height) of a pixel in CRS units, both positive
    count: int
    dtype: str

    @property
    def polygon(self) -> Polygon:
        return box(*self.bounds)

    def raster_size(self) -> tuple[int, int]:
        """The raster's width and height in pixels (its bounds over its pixel size)."""
        xmin, ymin, xmax, ymax = self.bounds
        return round((xmax - xmin) / self.pixel[0]), round((ymax - ymin) / self.pixel[1])

    def to_list(self) -> list[Any]:
        return [self.crs, list(self.bounds), list(self.pixel), self.count, self.dtype]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> Footprint:
        crs, bounds, pixel, count, dtype = data
        xmin, ymin, xmax, ymax = map(float, bounds)
        width, height = map(float, pixel)
        return cls(str(crs), (xmin, ymin, xmax, ymax), (width, height), int(count), str(dtype))


@dataclass(frozen=True)
class Seam:
    """The seam of scenes ``a < b``: its core (where its objects win), as WKT in the scenes' CRS."""

    a: str
    b: str
    core: str

    @property
    def name(self) -> str:
        return seam_name(self.a, self.b)


def seam_name(a: str, b: str) -> str:
    first, second = sorted((a, b))
    return f"{first}{SEAM_JOIN}{second}"


def is_seam(name: str) -> bool:
    return SEAM_JOIN in name


def seam_scenes(name: str) -> tuple[str, str]:
    a, b = name.split(SEAM_JOIN)
    return a, b


def mosaicable(first: Footprint, second: Footprint) -> bool:
    """Whether two scenes can be read as one mosaic: same CRS, pixel size, bands and data type."""
    same_pixel = all(abs(p - q) <= 1e-9 * max(p, q) for p, q in zip(first.pixel, second.pixel, strict=True))
    return first.crs == second.crs and same_pixel and (first.count, first.dtype) == (second.count, second.dtype)


def seam_line(a: Any, b: Any, tolerance: Any) -> Any:
    """Where one footprint's edge runs inside (or along) the other's (polygons, or arrays of them pairwise)."""
    return shapely.union(
        shapely.intersection(shapely.boundary(a), shapely.buffer(b, tolerance)),
        shapely.intersection(shapely.boundary(b), shapely.buffer(a, tolerance)),
    )


def find_seams(footprints: Mapping[str, Footprint], margin_px: int) -> list[Seam]:
    """The seams of every pair of scenes that touch or overlap along a line (not at a point only) and can be read
    as one mosaic, sorted by name. ``margin_px``: the core's half-width, in pixels. The geometry of all pairs is
    computed at once (shapely's array functions: 10,000 scenes of a survey have about 20,000 seams), once for all
    the pairs that are translates of one another (:func:`_pair_cores`: a survey's grid)."""
    names = sorted(footprints)
    if len(names) < 2:
        return []
    prints = [footprints[n] for n in names]
    bounds = np.array([p.bounds for p in prints], dtype=np.float64)
    i, j = _near_pairs(prints, bounds, _tolerance(footprints, names))
    pixels = np.array([p.pixel for p in prints], dtype=np.float64)
    pixel = np.maximum(pixels[i].max(axis=1), pixels[j].max(axis=1))
    keep = ~_corners_only(bounds[i], bounds[j], pixel)
    i, j, pixel = i[keep], j[keep], pixel[keep]
    wkts = _pair_cores(bounds[i], bounds[j], pixel, margin_px)
    pairs = [(names[a], names[b], wkt) for a, b, wkt in zip(i.tolist(), j.tolist(), wkts.tolist(), strict=True)]
    pairs.sort(key=lambda pair: f"{pair[0]}{SEAM_JOIN}{pair[1]}")  # by the seam's name (a < b)
    return [Seam(a, b, wkt) for a, b, wkt in pairs if wkt is not None]


def _near_pairs(prints: Sequence[Footprint], bounds: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``i < j`` of footprints (``bounds``, n x 4) within ``tolerance`` of one another (shapely's
    ``dwithin`` of their polygons) that can be read as one mosaic (:func:`mosaicable`)."""
    boxes = shapely.box(*bounds.T)
    grown = shapely.box(*(bounds + 2 * tolerance * np.array([-1.0, -1.0, 1.0, 1.0])).T)
    i, j = STRtree(boxes).query(grown)  # the envelopes that meet, a few more than the pairs within tolerance
    keep = i < j
    i, j = i[keep], j[keep]
    keep = _mosaicable_pairs(prints, i, j)
    i, j = i[keep], j[keep]
    apart = (np.minimum(bounds[i, 2:], bounds[j, 2:]) < np.maximum(bounds[i, :2], bounds[j, :2])).any(axis=1)
    if apart.any():  # a gap along x or y: as far as GEOS measures it (boxes that touch or overlap are within)
        shapely.prepare(boxes[i[apart]])
        near = np.ones(len(i), dtype=bool)
        near[apart] = shapely.dwithin(boxes[i[apart]], boxes[j[apart]], tolerance)
        i, j = i[near], j[near]
    return i, j


def _mosaicable_pairs(prints: Sequence[Footprint], i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """:func:`mosaicable` of the footprints' pairs (i, j), all at once."""
    kinds: dict[tuple[str, int, str], int] = {}
    kind = np.array([kinds.setdefault((p.crs, p.count, p.dtype), len(kinds)) for p in prints], dtype=np.intp)
    pixel = np.array([p.pixel for p in prints], dtype=np.float64)
    p, q = pixel[i], pixel[j]
    same_pixel = (np.abs(p - q) <= 1e-9 * np.maximum(p, q)).all(axis=1)
    return (kind[i] == kind[j]) & same_pixel


def _corners_only(a: np.ndarray, b: np.ndarray, pixel: np.ndarray) -> np.ndarray:
    """Pairs of footprints (bounds) apart or touching along one axis and overlapping by at most half a pixel along
    the other (a grid's diagonal neighbours): their :func:`seam_line` (each one's edge within a hundredth of a pixel
    of the other) is at most 4 hundredths of a pixel plus twice that overlap long, no border (:func:`_cores`)."""
    overlap = np.minimum(a[:, 2:], b[:, 2:]) - np.maximum(a[:, :2], b[:, :2])  # x, y; negative: apart
    low, high = overlap.min(axis=1), overlap.max(axis=1)
    return (low <= 0) & (high <= pixel / 2)


def _pair_cores(a: np.ndarray, b: np.ndarray, pixel: np.ndarray, margin_px: int) -> np.ndarray:
    """The cores (WKT; None where the two share no border) of the pairs of footprints ``a``, ``b`` (bounds, n x 4)
    at ``pixel``. Shapely computes those of each group of translates' (:func:`_translation_groups`) samples
    (:func:`_samples`); the group's other members get its first member's core moved by their offset where the
    samples move alike (2), else its first member's seam line and union widened moved, then widened (1), else
    (0, and the pairs alone) shapely's geometry of each."""
    group, first, unit = _translation_groups(a, b, pixel, margin_px)
    sample, line, both, core, moving = _samples(a, b, pixel, margin_px, group, first, unit)
    cores = np.full(len(a), None, dtype=object)
    cores[sample] = core
    todo = np.ones(len(a), dtype=bool)
    todo[sample] = False
    offset = a[:, :2] - a[first[group], :2]
    whole = np.flatnonzero(todo & (moving[group] == 2))
    cores[whole] = _translate(core[group[whole]], offset[whole])
    part = np.flatnonzero(todo & (moving[group] == 1))
    moved = _translate(line[group[part]], offset[part]), _translate(both[group[part]], offset[part])
    cores[part] = _widen(*moved, margin_px * pixel[part])
    rest = np.flatnonzero(todo & (moving[group] == 0))
    cores[rest] = _widen(*_borders(a[rest], b[rest], pixel[rest])[:2], margin_px * pixel[rest])
    return np.asarray(shapely.to_wkt(cores, rounding_precision=-1), dtype=object)


def _samples(
    a: np.ndarray,
    b: np.ndarray,
    pixel: np.ndarray,
    margin_px: int,
    group: np.ndarray,
    first: np.ndarray,
    unit: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shapely's geometry of each group's first member and, for a group of more than one, of :data:`SAMPLES` - 1
    other members spread through it (its last included) and of its first moved by a few units (where GEOS falls
    back, for robustness, to a grid or a snapping tolerance of the coordinates' magnitude, moving is not exact:
    that one then differs). The samples (the first members by group, then the others), their seam lines, unions
    widened by half a pixel and cores, and how far each group moves alike (:func:`_moving`; 0 for a group of one)."""
    order, sizes = np.argsort(group, kind="stable"), np.bincount(group)
    shared = np.flatnonzero(sizes > 1)
    spread = np.linspace(0, 1, SAMPLES)[1:] * (sizes[shared, None] - 1)
    others = order[(np.cumsum(sizes) - sizes)[shared, None] + np.round(spread).astype(np.intp)]
    probe = 6 * unit[shared]
    sample = np.concatenate([first, others.ravel()])
    index = np.concatenate([sample, first[shared]])
    line, both, union = _borders(
        np.concatenate([a[sample], a[first[shared]] + np.tile(probe, 2)]),
        np.concatenate([b[sample], b[first[shared]] + np.tile(probe, 2)]),
        pixel[index],
    )
    core = _widen(line, both, margin_px * pixel[index])
    shift = np.concatenate([(a[others, :2] - a[first[shared], None, :2]).reshape(-1, 2), probe])
    moving = np.zeros(len(first), dtype=np.intp)
    found = (line, both, union, core)
    moving[shared] = _moving(found, shared, shift, len(first), margin_px * pixel[first[shared]], pixel[first[shared]])
    return sample, line[: len(sample)], both[: len(sample)], core[: len(sample)], moving


def _moving(
    found: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    shared: np.ndarray,
    shift: np.ndarray,
    groups: int,
    width: np.ndarray,
    pixel: np.ndarray,
) -> np.ndarray:
    """How far each group of more than one (``shared``) moves alike, from its samples' geometry (``found``: seam
    lines, unions widened, unions and cores; each group's first member by group, then the groups' other samples
    and their firsts moved by a few units, which should be the first's moved by ``shift``): 2, the core (its seam
    line :func:`_steady` too), 1, the seam line and the union widened (the union's edge steady), else 0."""
    line, both, union, core = found
    origin = np.concatenate([np.repeat(shared, SAMPLES - 1), shared])

    def alike(geometries: np.ndarray) -> np.ndarray:
        moved = shapely.to_wkt(_translate(geometries[origin], shift), rounding_precision=-1)
        same = moved == shapely.to_wkt(geometries[groups:], rounding_precision=-1)
        spread, probed = same[: -len(shared)], same[-len(shared) :]
        return np.all(np.reshape(spread, (len(shared), SAMPLES - 1)), axis=1) & probed

    lines = _steady(shapely.boundary(union[shared]), pixel / 2) & alike(line) & alike(both)
    return np.where(lines & _steady(line[shared], width) & alike(core), 2, np.where(lines, 1, 0))


def _borders(a: np.ndarray, b: np.ndarray, pixel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The :func:`seam_line` of each pair of footprints ``a``, ``b`` (bounds, n x 4) at ``pixel``, and where it is
    a border (not corners that touch only) the two's union and that widened by half a pixel (else None)."""
    first, second = shapely.box(*a.T), shapely.box(*b.T)
    line = seam_line(first, second, pixel / 100)
    border = shapely.length(line) >= 2 * pixel  # a border to see across
    union = np.full(len(a), None, dtype=object)
    union[border] = shapely.union(first[border], second[border])
    both = np.full(len(a), None, dtype=object)
    both[border] = shapely.buffer(union[border], pixel[border] / 2, join_style="mitre")
    return line, both, union


def _widen(line: np.ndarray, both: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The cores: each seam line widened by ``width`` on both sides, within ``both`` (None where that is None)."""
    cores = np.full(len(line), None, dtype=object)
    border = ~shapely.is_missing(both)
    widened = shapely.buffer(line[border], width[border], cap_style="flat", join_style="mitre")
    cores[border] = shapely.intersection(widened, both[border])
    return cores


def _steady(lines: np.ndarray, distance: np.ndarray) -> np.ndarray:
    """Whether GEOS's buffer of each of these lines by ``distance`` has edges along x and y only (and cuts of its
    corners at about 45 degrees), where it computes the same crossings wherever the lines lie: every segment runs
    along x or y, the offsets of each straight run of them (those going on in one direction; each segment its own
    rounding) are the same, and no run's offset ends nearly meet another's (the run about 0, 1 or 2 distances
    long), where the buffer drops a vertex closer than :data:`SNAP` times the distance to the last: a sliver a
    float's unit wide (two scenes' bounds a unit apart), a stub of a hundredth of a pixel under a margin of 100
    pixels or more, become edges nearly parallel to others, whose crossings (some exactly half way between two
    floats) move by a unit as the coordinates' magnitude does."""
    parts, owner = shapely.get_parts(lines, return_index=True)
    xy, part = shapely.get_coordinates(parts, return_index=True)
    step = np.diff(xy, axis=0)
    kept = (part[1:] == part[:-1]) & (step != 0).any(axis=1)  # the segments, repeated points left out
    step, start, part = step[kept], xy[:-1][kept], part[1:][kept]
    owner = owner[part]
    along_y = step[:, 0] == 0
    length = np.where(along_y, step[:, 1], step[:, 0])
    offset = distance[owner] * length / np.abs(length)  # as GEOS computes it: each segment its own rounding
    level = np.where(along_y, start[:, 0], start[:, 1])
    on = (part[1:] == part[:-1]) & (along_y[1:] == along_y[:-1]) & (np.sign(length[1:]) == np.sign(length[:-1]))
    sides = (level - offset, level + offset)
    jog = on & ((sides[0][1:] != sides[0][:-1]) | (sides[1][1:] != sides[1][:-1]))
    run = np.cumsum(np.r_[True, ~on])[: len(length)] - 1
    ratio = np.bincount(run, np.abs(length), minlength=1)[run] / distance[owner]
    near = (ratio <= 1.1 * SNAP) | (np.abs(ratio - 1) <= 1.1 * SNAP) | (np.abs(ratio - 2) <= 1.1 * SNAP)
    unsteady = np.zeros(len(lines), dtype=bool)
    unsteady[owner[(step != 0).all(axis=1) | near]] = True
    unsteady[owner[1:][jog]] = True
    return ~unsteady


def _translation_groups(
    a: np.ndarray, b: np.ndarray, pixel: np.ndarray, margin_px: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs of footprints (bounds ``a``, ``b``) whose cores GEOS computes alike, one the other's moved by the
    offset of their ``a``'s lower left corners: the same shape (bounds relative to that corner, exact) and pixel,
    every coordinate the computation meets (the pair's bounds widened well beyond the core) in one binary order of
    magnitude whose unit (the spacing of its floats) is much finer than the pixel, and the offset an even number of
    units (each rounding moves with it, ties to even included). Each pair's group, each group's first member and
    its unit (x, y); a pair that cannot be moved is alone."""
    low, high = np.minimum(a[:, :2], b[:, :2]), np.maximum(a[:, 2:], b[:, 2:])
    pad = ((high - low).sum(axis=1) + 10 * (abs(margin_px) + 1) * pixel)[:, None]
    (low_mantissa, exponent), (high_mantissa, high_exponent) = np.frexp(low - pad), np.frexp(high + pad)
    unit = np.ldexp(1.0, exponent - 53)
    same = (exponent == high_exponent) & (np.sign(low_mantissa) == np.sign(high_mantissa)) & (low_mantissa != 0)
    movable = (same & (pixel[:, None] >= 2.0**19 * unit)).all(axis=1) & np.isfinite(pad[:, 0])
    corner = a[:, :2]
    shape = np.concatenate([a - np.tile(corner, 2), b - np.tile(corner, 2)], axis=1)
    parity = corner.view(np.int64) & 1  # the last bit of the corner's significand: the offset's units even
    alone = np.where(movable, -1, np.arange(len(a)))
    keys = np.column_stack([shape, pixel, parity, exponent, np.sign(low_mantissa), alone]).astype(np.float64)
    rows = np.ascontiguousarray(keys).view(np.dtype((np.void, keys.itemsize * keys.shape[1]))).ravel()
    _, first, group = np.unique(rows, return_index=True, return_inverse=True)
    return group.ravel(), first, unit[first]


def _translate(geometries: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each geometry moved by its offset (n x 2; exact where the offset keeps its coordinates' binary order of
    magnitude)."""
    counts = shapely.get_num_coordinates(geometries)
    return np.asarray(shapely.transform(geometries, lambda xy: xy + np.repeat(offsets, counts, axis=0)))


def tile_region(core: str, margin: float) -> shapely.Geometry:
    """Where a seam's tiles go: its core (WKT) widened by ``margin`` (CRS units)."""
    return tile_regions([core], np.array([margin]))[0]


def tile_regions(cores: Sequence[str], margins: np.ndarray) -> np.ndarray:
    """:func:`tile_region` of many seams at once (shapely's array functions): each core widened by its margin."""
    return np.asarray(shapely.buffer(shapely.from_wkt(np.asarray(cores, dtype=object)), margins, join_style="mitre"))


def source_area(source: ProjectSource, crs: str) -> shapely.Geometry | None:
    """A project source's footprint (a scene's ``bounds``) or core (a seam's, WKT), in the project's CRS ``crs``;
    None for a scene whose header the plan did not read (a demo scene not yet made)."""
    if source.core:
        area = shapely.from_wkt(source.core)
    elif source.bounds is not None:
        area = box(*source.bounds)
    else:
        return None
    if source.crs == crs:
        return area
    import geopandas as gpd

    step = max(area.length / 256, 1e-9)  # densified: a straight edge bends in another CRS
    return gpd.GeoSeries([shapely.segmentize(area, step)], crs=source.crs).to_crs(crs).iloc[0]


def _tolerance(footprints: Mapping[str, Footprint], names: Sequence[str]) -> float:
    """A hundredth of the largest pixel: abutting scenes whose bounds differ by rounding still touch."""
    return max((max(footprints[n].pixel) for n in names), default=0.0) / 100


class Ownership:
    """Which source (a scene or a seam) keeps an object centred at a point (see the module docstring).
    ``footprints`` and ``cores`` are polygons in one CRS (the project's)."""

    def __init__(self, footprints: Mapping[str, shapely.Geometry], cores: Mapping[str, shapely.Geometry]) -> None:
        self.footprints = dict(footprints)
        self.cores = dict(cores)
        self._scene_names = sorted(self.footprints)
        self._scene_tree = STRtree([self.footprints[n] for n in self._scene_names])
        self._seam_names = sorted(self.cores)
        self._seam_tree = STRtree([self.cores[n] for n in self._seam_names])
        self._mosaic_edges = {name: self._mosaic_edge(name) for name in self._seam_names}

    def _mosaic_edge(self, seam: str) -> shapely.Geometry:
        """The edge of the union of a seam's two scenes (its core's, where a scene's footprint is not known)."""
        scenes = [self.footprints[name] for name in seam_scenes(seam) if name in self.footprints]
        return shapely.boundary(shapely.union_all(scenes) if len(scenes) == 2 else self.cores[seam])

    def _deeper(self, seam: str, other: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Where ``seam``'s two scenes hold the point (x, y) deeper than ``other``'s do (farther inside the union of
        the two; by name on a tie)."""
        points = shapely.points(x, y)
        depth = shapely.distance(self._mosaic_edges[seam], points)
        rival = shapely.distance(self._mosaic_edges[other], points)
        return (depth > rival) | ((depth == rival) & (seam < other))

    def keeps(self, source: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """True where ``source`` owns the point (x, y): the objects it keeps."""
        if is_seam(source):
            keep = shapely.contains_xy(self.cores[source], x, y)
            area = self.cores[source]
        else:
            keep = np.ones(len(x), dtype=bool)
            area = self.footprints[source]
            for index in self._scene_tree.query(area, predicate="intersects"):
                other = self._scene_names[int(index)]
                if other < source:
                    keep &= ~shapely.contains_xy(self.footprints[other], x, y)
        for index in self._seam_tree.query(area, predicate="intersects"):
            seam = self._seam_names[int(index)]
            if seam == source:
                continue
            inside = shapely.contains_xy(self.cores[seam], x, y)
            if is_seam(source) and inside.any():  # crossing cores: the deeper seam keeps
                inside &= self._deeper(seam, source, x, y)
            keep &= ~inside
        return keep

    def scene_of(self, source: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The scene each point of a source lies in: a scene's own name; for a seam, the first of its two scenes
        that holds the point."""
        if not is_seam(source):
            return np.full(len(x), source, dtype=object)
        a, b = seam_scenes(source)
        inside = shapely.contains_xy(self.footprints[a], x, y) if a in self.footprints else np.ones(len(x), bool)
        return np.where(inside, a, b).astype(object)
