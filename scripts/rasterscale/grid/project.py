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

SEAM_JOIN = "+"


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
    computed at once (shapely's array functions: 10,000 scenes of a survey have about 20,000 seams)."""
    names = sorted(footprints)
    if len(names) < 2:
        return []
    polygons = np.array([footprints[n].polygon for n in names], dtype=object)
    near = STRtree(polygons).query(polygons, predicate="dwithin", distance=_tolerance(footprints, names))
    pairs = [
        (i, j)
        for i, j in zip(*near.tolist(), strict=True)
        if i < j and mosaicable(footprints[names[i]], footprints[names[j]])
    ]
    if not pairs:
        return []
    i, j = (np.array(side, dtype=np.intp) for side in zip(*pairs, strict=True))
    pixel = np.array([max(*footprints[names[a]].pixel, *footprints[names[b]].pixel) for a, b in pairs])
    line = seam_line(polygons[i], polygons[j], pixel / 100)
    border = shapely.length(line) >= 2 * pixel  # not corners that touch only: a border to see across
    i, j, pixel, line = i[border], j[border], pixel[border], line[border]
    both = shapely.buffer(shapely.union(polygons[i], polygons[j]), pixel / 2, join_style="mitre")
    cores = shapely.intersection(shapely.buffer(line, margin_px * pixel, cap_style="flat", join_style="mitre"), both)
    wkts = shapely.to_wkt(cores, rounding_precision=-1)
    seams = [Seam(names[a], names[b], wkt) for a, b, wkt in zip(i.tolist(), j.tolist(), wkts.tolist(), strict=True)]
    return sorted(seams, key=lambda s: s.name)


def tile_region(core: str, margin: float) -> shapely.Geometry:
    """Where a seam's tiles go: its core (WKT) widened by ``margin`` (CRS units)."""
    return tile_regions([core], np.array([margin]))[0]


def tile_regions(cores: Sequence[str], margins: np.ndarray) -> np.ndarray:
    """:func:`tile_region` of many seams at once (shapely's array functions): each core widened by its margin."""
    return np.asarray(shapely.buffer(shapely.from_wkt(np.asarray(cores, dtype=object)), margins, join_style="mitre"))


def source_area(source: Mapping[str, Any], crs: str) -> shapely.Geometry | None:
    """A project source's footprint (a scene's ``bounds``) or core (a seam's, WKT), in the project's CRS ``crs``;
    None for a scene whose header the plan did not read (a demo scene not yet made)."""
    if "core" in source:
        area = shapely.from_wkt(source["core"])
    elif "bounds" in source:
        area = box(*source["bounds"])
    else:
        return None
    if source["crs"] == crs:
        return area
    import geopandas as gpd

    step = max(area.length / 256, 1e-9)  # densified: a straight edge bends in another CRS
    return gpd.GeoSeries([shapely.segmentize(area, step)], crs=source["crs"]).to_crs(crs).iloc[0]


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
