"""A class map's polygons (``classes.gpkg``): :func:`vectorize_classes` polygonizes the map block by block
(4-connected pixels of one class make one polygon); the pieces of a region cut by block boundaries are joined,
held only while they touch the frontier of blocks still to come and within a vertex budget, so memory is a block
plus that budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import geopandas as gpd
import numpy as np
import pyogrio
import rasterio
import shapely
from affine import Affine
from rasterio.features import rasterize, shapes
from rasterio.windows import Window

from rasterscale.atomic import atomic_gpkg
from rasterscale.tasks.merging import CACHE_MB, block_windows
from rasterscale.tasks.segmentation import NODATA_CLASS

VECTOR_LAYER = "classes"


WRITE_BATCH = 10_000  # polygons per append to the GeoPackage, at most


WRITE_BATCH_VERTICES = 200_000  # and vertices, at most


VECTOR_BLOCK = 1024  # vectorizing reads the class map in blocks of this side


MAX_OPEN_VERTICES = 100_000  # regions held open across blocks; beyond, the largest are written and go on anew


MAX_REGION_VERTICES = 20_000  # a region held open beyond this is written and goes on anew (joining costs its square)


@dataclass
class Region:
    """4-connected pixels of one class, as the polygons of its pieces in pixel coordinates (one per block), and
    their vertex count (what holding it open costs)."""

    class_id: int
    pieces: list = field(default_factory=list)
    vertices: int = 0


def block_pieces(data: np.ndarray, window: Window, skip: Sequence[int]) -> list[tuple[shapely.Geometry, int]]:
    """(polygon in the raster's pixel coordinates, class id) of the 4-connected regions of a block, skipped
    classes left out."""
    keep = ~np.isin(data, list(skip))
    if not keep.any():
        return []
    offset = Affine.translation(window.col_off, window.row_off)
    found = shapes(data, mask=keep, connectivity=4, transform=offset)
    return [(ring_polygon(geometry["coordinates"]), int(value)) for geometry, value in found]


def ring_polygon(rings: Sequence[Sequence[tuple[float, float]]]) -> shapely.Polygon:
    """The polygon of a GeoJSON polygon's rings (the shell, then the holes): what ``shapely.geometry.shape`` makes
    of it, each ring's coordinates taken as one array (shape's Python loop over every coordinate took half as
    long as polygonizing the block)."""
    shell, *holes = (np.asarray(ring, dtype=np.float64) for ring in rings)
    return shapely.Polygon(shell, holes)


def touches_edge(bounds: tuple[float, float, float, float], window: Window) -> bool:
    col0, row0 = window.col_off, window.row_off
    return (
        bounds[0] <= col0 or bounds[1] <= row0 or bounds[2] >= col0 + window.width or bounds[3] >= row0 + window.height
    )


def piece_labels(pieces: Sequence[tuple[shapely.Geometry, int]], window: Window) -> np.ndarray:
    """Which piece (its index in ``pieces`` + 1; 0 for none) holds each pixel of the block."""
    shape = (int(window.height), int(window.width))
    if not pieces:
        return np.zeros(shape, dtype=np.int32)
    return rasterize(
        ((polygon, k + 1) for k, (polygon, _) in enumerate(pieces)),
        out_shape=shape,
        transform=Affine.translation(window.col_off, window.row_off),
        fill=0,
        dtype="int32",
    )


def roots_of(parents: np.ndarray) -> np.ndarray:
    """Every node's root in a union-find forest given as a parent array (path halving until it is flat)."""
    while True:
        grand = parents[parents]
        if np.array_equal(grand, parents):
            return parents
        parents = grand


def union_pairs(parents: np.ndarray, pairs: np.ndarray, regions: Sequence[Region]) -> None:
    """Join the regions of each (a, b) pair of one class (ids index ``regions`` + 1) in ``parents``."""
    for a, b in pairs.tolist():
        if regions[a - 1].class_id != regions[b - 1].class_id:
            continue
        root_a, root_b = a, b
        while parents[root_a] != root_a:
            root_a = parents[root_a]
        while parents[root_b] != root_b:
            root_b = parents[root_b]
        if root_a != root_b:
            parents[max(root_a, root_b)] = min(root_a, root_b)


def edge_pairs(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The distinct (region id, region id) of pixels facing each other across a block edge, both in a region."""
    both = (before > 0) & (after > 0)
    if not both.any():
        return np.zeros((0, 2), dtype=np.int64)
    return np.unique(np.stack([before[both], after[both]], axis=1), axis=0)


class Vectorizer:
    """Regions of a class map fed block by block in row-major order (see :func:`vectorize_classes`).

    The regions still open are those on the frontier: the bottom row of the blocks above (``below``, one region id
    per column of the raster) and the right column of the block to the left (``right``). A block's pieces are
    joined with the frontier regions they share an edge with; a region that leaves the frontier is finished. A
    piece or region of more than ``max_region_vertices`` vertices is finished where it is, as are the largest
    open regions while they hold more than ``max_open_vertices`` together; their continuation starts a new
    region."""

    def __init__(self, width: int, height: int, max_open_vertices: int, max_region_vertices: int) -> None:
        self.width, self.height = width, height
        self.max_open_vertices, self.max_region_vertices = max_open_vertices, max_region_vertices
        self.regions: list[Region] = []  # open regions, id = index + 1
        self.below = np.zeros(width, dtype=np.int32)
        self.right: np.ndarray | None = None

    def add_block(self, data: np.ndarray, window: Window, skip: Sequence[int]) -> list[Region]:
        """Feed one block; returns the regions it finished."""
        pieces = block_pieces(data, window, skip)
        vertices = shapely.get_num_coordinates([p for p, _ in pieces]).tolist() if pieces else []
        joinable = [
            touches_edge(p.bounds, window) and n <= self.max_region_vertices
            for (p, _), n in zip(pieces, vertices, strict=True)
        ]
        finished = [Region(c, [p], n) for (p, c), n, j in zip(pieces, vertices, joinable, strict=True) if not j]
        edge = [(p, c, n) for (p, c), n, j in zip(pieces, vertices, joinable, strict=True) if j]
        labels = piece_labels([(p, c) for p, c, _ in edge], window)
        first = len(self.regions)
        regions = [*self.regions, *(Region(c, [p], n) for p, c, n in edge)]
        ids = np.arange(first, first + len(edge) + 1, dtype=np.int32)
        ids[0] = 0
        block = ids[labels]  # region id per pixel of the block
        cols = slice(int(window.col_off), int(window.col_off + window.width))
        pairs = [edge_pairs(self.below[cols], block[0])]
        if self.right is not None:  # None at the first block of a row of blocks
            pairs.append(edge_pairs(self.right, block[:, 0]))
        parents = np.arange(len(regions) + 1, dtype=np.int64)
        union_pairs(parents, np.concatenate(pairs), regions)
        roots = roots_of(parents)
        last_row = window.row_off + window.height >= self.height
        last_col = window.col_off + window.width >= self.width
        self.below[cols] = 0 if last_row else block[-1]
        self.below = roots[self.below].astype(np.int32)
        self.right = None if last_col else roots[block[:, -1]].astype(np.int32)
        joined: dict[int, Region] = {}
        for k, region in enumerate(regions, start=1):
            root = int(roots[k])
            if root not in joined:
                joined[root] = region  # a root is its group's smallest id: met first
            else:
                joined[root].pieces.extend(region.pieces)
                joined[root].vertices += region.vertices
        open_ids = set(np.unique(self.below).tolist()) | set(
            np.unique(self.right).tolist() if self.right is not None else []
        )
        open_ids.discard(0)
        finished.extend(region for root, region in joined.items() if root not in open_ids)
        finished.extend(self._over_budget(joined, open_ids))
        self._renumber(joined, sorted(open_ids))
        return finished

    def _over_budget(self, joined: dict[int, Region], open_ids: set[int]) -> list[Region]:
        """Finish (and remove from ``open_ids``) the open regions of too many vertices, then the largest while the
        open ones hold too many together."""
        total = sum(joined[k].vertices for k in open_ids)
        closed = []
        for k in sorted(open_ids, key=lambda k: joined[k].vertices, reverse=True):
            if total <= self.max_open_vertices and joined[k].vertices <= self.max_region_vertices:
                break
            total -= joined[k].vertices
            open_ids.discard(k)
            closed.append(joined[k])
        return closed

    def _renumber(self, joined: dict[int, Region], open_ids: list[int]) -> None:
        """Keep the open regions only, numbered 1.. in id order, in the frontier too."""
        remap = np.zeros(max([0, *joined]) + 1, dtype=np.int32)
        for new, old in enumerate(open_ids, start=1):
            remap[old] = new
        self.below = remap[self.below]
        if self.right is not None:
            self.right = remap[self.right]
        self.regions = [joined[k] for k in open_ids]


def region_row(region: Region, transform: Affine, labels: Sequence[str]) -> dict:
    polygon = region.pieces[0] if len(region.pieces) == 1 else shapely.union_all(region.pieces)
    geometry = shapely.affinity.affine_transform(
        polygon, [transform.a, transform.b, transform.d, transform.e, transform.c, transform.f]
    )
    label = labels[region.class_id] if region.class_id < len(labels) else f"class {region.class_id}"
    return {"class_id": region.class_id, "label": label, "area": geometry.area, "geometry": geometry}


def vectorize_classes(
    classes_path: str | Path,
    gpkg_path: str | Path,
    labels: Sequence[str],
    skip_background: bool = True,
    block: int = VECTOR_BLOCK,
    cache_mb: int = CACHE_MB,
    max_open_vertices: int = MAX_OPEN_VERTICES,
    max_region_vertices: int = MAX_REGION_VERTICES,
) -> int:
    """Polygons of the class map (columns class_id, label, area in CRS units; the raster's CRS; layer "classes")
    in a GeoPackage, atomically; class 0 is skipped when it is "background" and ``skip_background``. Returns the
    number of polygons. GDAL's block cache is bounded to ``cache_mb`` meanwhile.

    The map is read in ``block`` x ``block`` windows, row by row; a region is one polygon whichever blocks it
    crosses, unless it has more than ``max_region_vertices`` vertices (a noisy forest across a 100k px raster:
    joining costs about the square of its size), or the regions held open across block boundaries pass
    ``max_open_vertices`` together: such regions are written in parts that end at block boundaries. Memory is a
    block, a row of region ids across the raster and that vertex budget, whatever the raster's size."""
    skip = [NODATA_CLASS, *([0] if skip_background and labels and labels[0] == "background" else [])]
    records: list[dict] = []
    pending_vertices = 0
    written = 0
    with (
        rasterio.Env(GDAL_CACHEMAX=cache_mb * 2**20),
        rasterio.open(classes_path) as src,
        atomic_gpkg(gpkg_path) as tmp,
    ):

        def flush(force: bool) -> None:
            nonlocal written, pending_vertices
            full = len(records) >= WRITE_BATCH or pending_vertices >= WRITE_BATCH_VERTICES
            if (records and (force or full)) or (force and not written):
                frame = gpd.GeoDataFrame(records, columns=["class_id", "label", "area", "geometry"], crs=src.crs)
                frame = frame.astype({"class_id": "int32", "label": "str", "area": "float64"})
                pyogrio.write_dataframe(
                    frame, tmp, layer=VECTOR_LAYER, driver="GPKG", append=written > 0, geometry_type="Polygon"
                )
                written += len(records) or 0
                records.clear()
                pending_vertices = 0

        vectorizer = Vectorizer(src.width, src.height, max_open_vertices, max_region_vertices)
        for window in block_windows(src.width, src.height, block):
            finished = vectorizer.add_block(src.read(1, window=window), window, skip)
            for region in finished:
                records.append(region_row(region, src.transform, labels))
                pending_vertices += region.vertices
                flush(force=False)
        flush(force=True)
    return written
