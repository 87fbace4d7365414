"""One scene's class map from its ranks' rasters (``classes.tif``, optionally ``probabilities.tif``), and its
polygons (``classes.gpkg``).

:func:`merge_class_rasters` assembles the rank rasters block by block: a block starts as no data (255) and takes
the pixels each rank raster claims (a pixel claimed twice is an error naming both files); pixels the scene's
imagery marks invalid become no data. The assembled raster becomes a COG whose overviews take the most frequent
class (mode); the probabilities' overviews are averages. Memory is a block's pixels, whatever the raster's size.

:func:`vectorize_classes` polygonizes the class map strip by strip (4-connected pixels of one class make one
polygon); the pieces of a region cut by strip boundaries are joined, carried over only while they touch the
boundary, so memory is a strip plus the regions open at its lower edge.
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

from rasterscale.cog import convert_to_cog
from rasterscale.imagery import ImageSpec, read_masked
from rasterscale.outputs import atomic_path
from rasterscale.segmentation import NODATA_CLASS
from rasterscale.segmentation.blend import PROBABILITY_SCALE, intersection

MERGE_BLOCK = 512
CACHE_MB = 64  # GDAL's block cache while merging or vectorizing (its default, 5% of the node's memory, fills up)
VECTOR_LAYER = "classes"
WRITE_BATCH = 10_000  # polygons per append to the GeoPackage
MAX_REGION_PIXELS = 2048 * 2048  # a region larger than this is written at a strip boundary, its rest as a new one


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
        if common.width <= 0 or common.height <= 0:
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
    """4-connected pixels of one class, as the polygons of its pieces in pixel coordinates (one per strip)."""

    class_id: int
    pieces: list = field(default_factory=list)


def strip_pieces(data: np.ndarray, row_off: int, skip: Sequence[int]) -> list[tuple[object, int]]:
    """(polygon in pixel coordinates, class id) of the 4-connected regions of a strip, skipped classes left out."""
    keep = ~np.isin(data, list(skip))
    if not keep.any():
        return []
    found = shapes(data, mask=keep, connectivity=4, transform=Affine.translation(0, row_off))
    return [(shapely.geometry.shape(geometry), int(value)) for geometry, value in found]


def row_labels(pieces: Sequence[tuple[object, int]], row: int, width: int) -> np.ndarray:
    """Which piece (index + 1; 0 for none) holds each pixel of raster row ``row``."""
    touching = [
        (polygon, k + 1) for k, (polygon, _) in enumerate(pieces) if polygon.bounds[1] <= row < polygon.bounds[3]
    ]
    if not touching:
        return np.zeros(width, dtype=np.int32)
    return rasterize(touching, out_shape=(1, width), transform=Affine.translation(0, row), fill=0, dtype="int32")[0]


def find_root(parents: list[int], k: int) -> int:
    while parents[k] != k:
        parents[k] = parents[parents[k]]
        k = parents[k]
    return k


def join_regions(
    above: list[Region], above_row: np.ndarray, new: list[Region], top_row: np.ndarray
) -> tuple[list[Region], list[int]]:
    """Regions open above a strip boundary joined with the strip's pieces they share an edge with (``above_row``,
    ``top_row``: the region index + 1 of each pixel either side of the boundary, 0 where none or another class).
    Returns the joined regions and, per piece of the strip, the index of its region."""
    parents = list(range(len(above) + len(new)))
    linked = (above_row > 0) & (top_row > 0)
    for a, b in set(zip(above_row[linked].tolist(), top_row[linked].tolist(), strict=True)):
        root_a, root_b = find_root(parents, a - 1), find_root(parents, len(above) + b - 1)
        if root_a != root_b:
            parents[root_b] = root_a
    joined: dict[int, Region] = {}
    for k, region in enumerate([*above, *new]):
        root = find_root(parents, k)
        if root in joined:
            joined[root].pieces.extend(region.pieces)
        else:
            joined[root] = Region(region.class_id, list(region.pieces))
    order = {root: index for index, root in enumerate(joined)}
    return list(joined.values()), [order[find_root(parents, len(above) + k)] for k in range(len(new))]


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
    strip_rows: int = 1024,
    cache_mb: int = CACHE_MB,
    max_region_pixels: int = MAX_REGION_PIXELS,
) -> int:
    """Polygons of the class map (columns class_id, label, area in CRS units; the raster's CRS; layer "classes")
    in a GeoPackage, atomically; class 0 is skipped when it is "background" and ``skip_background``. Returns the
    number of polygons. GDAL's block cache is bounded to ``cache_mb`` meanwhile.

    A region is one polygon however many strips it crosses, up to ``max_region_pixels``: a larger one (a forest
    across the raster) is written at the strip boundary where it passes that size and goes on as a new polygon,
    so that memory stays bounded by a strip and regions of bounded size."""
    skip = [NODATA_CLASS, *([0] if skip_background and labels and labels[0] == "background" else [])]
    records: list[dict] = []
    written = 0
    with (
        rasterio.Env(GDAL_CACHEMAX=cache_mb * 2**20),
        rasterio.open(classes_path) as src,
        atomic_path(gpkg_path) as tmp,
    ):

        def flush(force: bool) -> None:
            nonlocal written
            if (records and (force or len(records) >= WRITE_BATCH)) or (force and not written):
                frame = gpd.GeoDataFrame(records, columns=["class_id", "label", "area", "geometry"], crs=src.crs)
                frame = frame.astype({"class_id": "int32", "label": "str", "area": "float64"})
                pyogrio.write_dataframe(
                    frame, tmp, layer=VECTOR_LAYER, driver="GPKG", append=written > 0, geometry_type="Polygon"
                )
                written += len(records) or 0
                records.clear()

        open_regions: list[Region] = []
        open_row = np.zeros(src.width, dtype=np.int32)
        previous_classes = np.full(src.width, NODATA_CLASS, dtype=np.uint8)
        for row_off in range(0, src.height, strip_rows):
            height = min(strip_rows, src.height - row_off)
            data = src.read(1, window=Window(0, row_off, src.width, height))
            pieces = strip_pieces(data, row_off, skip)
            new = [Region(class_id, [polygon]) for polygon, class_id in pieces]
            top = row_labels(pieces, row_off, src.width)
            top[data[0] != previous_classes] = 0
            regions, region_of_piece = join_regions(open_regions, open_row, new, top)
            bottom = row_labels(pieces, row_off + height - 1, src.width)
            still_open = sorted({region_of_piece[k - 1] for k in np.unique(bottom[bottom > 0]).tolist()})
            if row_off + height >= src.height:
                still_open = []
            still_open = [k for k in still_open if sum(p.area for p in regions[k].pieces) <= max_region_pixels]
            keep = set(still_open)
            records.extend(region_record(r, src.transform, labels) for k, r in enumerate(regions) if k not in keep)
            flush(force=False)
            index = np.zeros(len(regions) + 1, dtype=np.int32)
            for position, k in enumerate(still_open):
                index[k + 1] = position + 1
            piece_region = np.asarray([0, *[k + 1 for k in region_of_piece]], dtype=np.int32)
            open_row = index[piece_region[bottom]]
            open_regions = [regions[k] for k in still_open]
            previous_classes = data[-1].copy()
        flush(force=True)
    return written
