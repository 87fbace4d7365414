"""One scene's class map from its ranks' rasters (``classes.tif``, optionally ``probabilities.tif``), and its
polygons (``classes.gpkg``).

:func:`merge_class_rasters` assembles the rank rasters block by block: a block starts as no data (255) and takes
the pixels each rank raster claims (a pixel claimed twice is an error naming both files); pixels the scene's
imagery marks invalid become no data. The assembled raster becomes a COG whose overviews take the most frequent
class (mode); the probabilities' overviews are averages. Memory is a block's pixels, whatever the raster's size.

:func:`vectorize_classes` polygonizes the class map block by block (4-connected pixels of one class make one
polygon); the pieces of a region cut by block boundaries are joined, held only while they touch the frontier of
blocks still to come and within a vertex budget, so memory is a block plus that budget.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
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

from rasterscale.atomic import atomic_path
from rasterscale.raster.cog import convert_to_cog
from rasterscale.raster.imagery import ImageSpec, decoding, read_masked
from rasterscale.raster.windows import intersection
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.rankraster import PROBABILITY_SCALE

MERGE_BLOCK = 512
CACHE_MB = 16  # GDAL's block cache while merging or vectorizing (each block is read once; GDAL's default, 5%
# of the node's memory, would fill up with blocks never read again)
VECTOR_LAYER = "classes"
WRITE_BATCH = 10_000  # polygons per append to the GeoPackage, at most
WRITE_BATCH_VERTICES = 200_000  # and vertices, at most
VECTOR_BLOCK = 1024  # vectorizing reads the class map in blocks of this side
MAX_OPEN_VERTICES = 100_000  # regions held open across blocks; beyond, the largest are written and go on anew
MAX_REGION_VERTICES = 20_000  # a region held open beyond this is written and goes on anew (joining costs its square)


@contextlib.contextmanager
def scratch_path(near: Path, name: str) -> Iterator[Path]:
    """A temporary file next to ``near`` (same file system), removed afterwards whatever happens."""
    path = near.with_name(f".{near.stem}.{name}-{os.getpid()}.tif")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def rank_window(src: rasterio.io.DatasetReader, scene: rasterio.io.DatasetReader, path: str | Path) -> Window:
    """Where a rank raster lies in the scene's pixel grid; one that is not on the grid fails naming the file."""
    t, s = src.transform, scene.transform
    col, row = (t.c - s.c) / s.a, (t.f - s.f) / s.e
    if (
        src.crs != scene.crs
        or not np.allclose((t.a, t.b, t.d, t.e), (s.a, s.b, s.d, s.e))
        or abs(col - round(col)) > 1e-6
        or abs(row - round(row)) > 1e-6
    ):
        raise ValueError(f"{path}: rank raster is not on the scene's pixel grid (CRS, resolution or offset)")
    window = Window(round(col), round(row), src.width, src.height)
    if (
        window.col_off < 0
        or window.row_off < 0
        or window.col_off + window.width > scene.width
        or window.row_off + window.height > scene.height
    ):
        raise ValueError(f"{path}: rank raster reaches outside the scene ({window} in {scene.width}x{scene.height})")
    return window


def window_valid_mask(src: rasterio.io.DatasetReader, spec: ImageSpec, window: Window) -> np.ndarray | None:
    """Valid pixels of a window under the spec's mask (None: all valid); reads the mask alone where it is a band
    or GDAL's mask, the bands for a nodata value or float pixels."""
    floats = any(np.dtype(src.dtypes[band - 1]).kind == "f" for band in spec.bands)
    if spec.mask == "none" and not floats:
        return None
    with decoding(src.name, window):
        if spec.mask == "alpha" and not floats:
            return src.read(spec.alpha, window=window) > 0
        if spec.mask == "dataset" and not floats:
            return src.dataset_mask(window=window) > 0
    return read_masked(src, spec, window=window)[1]


def block_windows(width: int, height: int, block: int) -> list[Window]:
    return [
        Window(col, row, min(block, width - col), min(block, height - row))
        for row in range(0, height, block)
        for col in range(0, width, block)
    ]


def assembly_profile(scene: rasterio.io.DatasetReader, count: int, block: int, nodata: int | None) -> dict:
    return {
        "driver": "GTiff",
        "width": scene.width,
        "height": scene.height,
        "count": count,
        "dtype": "uint8",
        "crs": scene.crs,
        "transform": scene.transform,
        "nodata": nodata,
        "tiled": True,
        "blockxsize": block,
        "blockysize": block,
        "compress": "deflate",
    }


def merge_class_rasters(
    rank_rasters: Sequence[str | Path],
    raster_path: str | Path,
    spec: ImageSpec,
    classes_path: str | Path,
    probabilities_path: str | Path | None,
    labels: Sequence[str],
    block: int = MERGE_BLOCK,
    cache_mb: int = CACHE_MB,
) -> dict:
    """Assemble the rank rasters into ``classes_path`` (uint8 COG, nodata 255, mode overviews; the scene's CRS,
    transform and size) and, when asked, ``probabilities_path`` (one uint8 band per class, scale 1/255, an
    internal mask where there is no class, average overviews). Returns pixels per class label and no data pixels.
    GDAL's block cache is bounded to ``cache_mb`` meanwhile.
    """
    num_classes = len(labels)
    counts = np.zeros(256, dtype=np.int64)
    classes_path = Path(classes_path)
    with contextlib.ExitStack() as stack:
        stack.enter_context(rasterio.Env(GDAL_CACHEMAX=cache_mb * 2**20))
        scene = stack.enter_context(rasterio.open(raster_path))
        ranks = []
        for path in rank_rasters:
            src = stack.enter_context(rasterio.open(path))
            if probabilities_path is not None and src.count != 1 + num_classes:
                raise ValueError(f"{path}: {src.count} bands, expected 1 + {num_classes} (classes and probabilities)")
            ranks.append((str(path), src, rank_window(src, scene, path)))
        tmp_classes = stack.enter_context(scratch_path(classes_path, "assembly"))
        classes_dst = stack.enter_context(
            rasterio.open(tmp_classes, "w", **assembly_profile(scene, 1, block, NODATA_CLASS))
        )
        classes_dst.update_tags(labels=json.dumps(list(labels)))
        classes_dst.set_band_description(1, "class")
        probs_dst = None
        if probabilities_path is not None:
            probabilities_path = Path(probabilities_path)
            tmp_probs = stack.enter_context(scratch_path(probabilities_path, "assembly"))
            stack.enter_context(rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True))
            probs_dst = stack.enter_context(
                rasterio.open(tmp_probs, "w", **assembly_profile(scene, num_classes, block, None))
            )
            probs_dst.scales = [PROBABILITY_SCALE] * num_classes
            probs_dst.descriptions = tuple(f"probability of {label}" for label in labels)
        for window in block_windows(scene.width, scene.height, block):
            classes, probs = assemble_block(ranks, window, num_classes if probs_dst is not None else 0)
            valid = window_valid_mask(scene, spec, window)
            if valid is not None:
                classes[~valid] = NODATA_CLASS
            counts += np.bincount(classes.ravel(), minlength=256)
            classes_dst.write(classes, 1, window=window)
            if probs_dst is not None:
                probs_dst.write(probs, window=window)
                probs_dst.write_mask(np.where(classes != NODATA_CLASS, 255, 0).astype(np.uint8), window=window)
        classes_dst.close()
        convert_to_cog(tmp_classes, classes_path, block_size=block, overview_resampling="mode")
        if probs_dst is not None:
            probs_dst.close()
            assert probabilities_path is not None  # probs_dst is opened for a probabilities_path only
            convert_to_cog(
                tmp_probs, probabilities_path, block_size=block, overview_resampling="average", add_mask=True
            )
    return class_summary(counts, labels)


def assemble_block(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]], window: Window, num_probabilities: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """One block's classes (255 where no rank claims a pixel) and, when ``num_probabilities``, probabilities
    (C, h, w); a pixel claimed by two rank rasters raises ValueError naming both."""
    shape = (int(window.height), int(window.width))
    classes = np.full(shape, NODATA_CLASS, dtype=np.uint8)
    owner = np.full(shape, -1, dtype=np.int32)
    probs = np.zeros((num_probabilities, *shape), dtype=np.uint8) if num_probabilities else None
    for index, (path, src, rank) in enumerate(ranks):
        common = intersection(window, rank)
        if common is None:
            continue
        inside = Window(common.col_off - rank.col_off, common.row_off - rank.row_off, common.width, common.height)
        rows = slice(common.row_off - window.row_off, common.row_off - window.row_off + common.height)
        cols = slice(common.col_off - window.col_off, common.col_off - window.col_off + common.width)
        data = src.read(1, window=inside)
        claimed = data != NODATA_CLASS
        clash = claimed & (owner[rows, cols] >= 0)
        if clash.any():
            r, c = (int(v[0]) for v in np.nonzero(clash))
            other = ranks[owner[rows, cols][r, c]][0]
            raise ValueError(
                f"pixel (row {common.row_off + r}, col {common.col_off + c}) claimed by two rank rasters: "
                f"{other} and {path}"
            )
        classes[rows, cols][claimed] = data[claimed]
        owner[rows, cols][claimed] = index
        if probs is not None:
            values = src.read(list(range(2, 2 + num_probabilities)), window=inside)
            probs[:, rows, cols][:, claimed] = values[:, claimed]
    return classes, probs


def class_summary(counts: np.ndarray, labels: Sequence[str]) -> dict:
    """Pixels per class label (ids without a label as ``class <id>``) and no data pixels."""
    pixels = {label: int(counts[k]) for k, label in enumerate(labels)}
    for class_id in np.flatnonzero(counts):
        if len(labels) <= class_id < NODATA_CLASS:
            pixels[f"class {class_id}"] = int(counts[class_id])
    return {"pixels": pixels, "nodata_pixels": int(counts[NODATA_CLASS])}


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
    return [(shapely.geometry.shape(geometry), int(value)) for geometry, value in found]


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


def region_record(region: Region, transform: Affine, labels: Sequence[str]) -> dict:
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
        atomic_path(gpkg_path) as tmp,
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
                records.append(region_record(region, src.transform, labels))
                pending_vertices += region.vertices
                flush(force=False)
        flush(force=True)
    return written
