"""Tree tops from a height raster: the local maxima of a canopy height model in a window that grows with height.

This is lidR's ``locate_trees(chm, lmf(ws, hmin))`` on a raster (a model's predicted canopy height, one scene's COG
or a VRT mosaic of several), of any size, read block by block:

- the rule (:class:`TreeTopRule`): a pixel at least ``min_height`` metres high is a tree top when no pixel of its
  circular window is higher; the window's diameter grows with the pixel's own height, ``intercept + slope *
  height`` metres clipped to ``[min_diameter, max_diameter]`` (the defaults are lidR's documented example
  ``ws = 0.1 * h + 3``, up to 10 m: a 20 m tree looks 2.5 m around itself, a 5 m one 1.75 m). In pixels the radius
  is ``R = max(1, round(diameter / 2 / pixel_size))`` and the window is the pixels whose centres lie within
  ``R + 1/2`` pixels of its centre (``dy² + dx² <= R (R + 1)``: for R = 1 its 3 × 3 neighbourhood);
- the search (:func:`local_maxima`): a square inscribed in the smallest window occurring (one separable
  ``scipy.ndimage.maximum_filter``) leaves a sparse set of survivors, each then compared with every pixel of its
  own disc (numpy over survivors × offsets, chunked). Exact, and linear in the pixels: a disc filter per distinct
  radius costs ``π R²`` per pixel, R reaching 50 on 10 cm pixels;
- plateaus: touching tied pixels (a flat crown top, a quantized height model) are one top, the pixel of the
  plateau nearest its centroid (ties by row, then column, in the raster's pixel coordinates), so the choice depends
  on the plateau alone. Tied pixels that do not touch are separate tops;
- blocks (:func:`find_tree_tops`): each ``block × block`` core is read with a halo of the largest window radius plus
  a plateau margin (clipped at the raster's edge) and keeps the tops whose pixel lies in its core: every top is
  found once, whatever the block size, equal to a whole-raster computation; memory is bounded by the block size.
  A plateau that reaches beyond the margin grows the halo (the margin doubles) up to half a block; a plateau wider
  still may be found once per block it crosses (logged as a warning);
- invalid pixels (the band's nodata value, the dataset's mask, NaN) are never tops and never win a window; pixels
  outside the raster do not exist for a window.

Tops are points at pixel centres in the raster's CRS with their ``height``, written as a GeoPackage (layer
``tree_tops``) and a GeoParquet (:func:`write_tree_tops`), and scored against true tops by one-to-one matching
within a distance (:func:`score_tree_tops`). Torch-free: numpy, scipy, rasterio and geopandas.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import rasterio
from affine import Affine
from rasterio.transform import xy
from rasterio.windows import Window

from rasterscale.atomic import write_geoparquet, write_gpkg
from rasterscale.errors import InputError
from rasterscale.raster.geometry_checks import check_points, read_features
from rasterscale.raster.remote import open_raster, shown
from rasterscale.tasks.pointmatching import match_points, square_pixel_size

# scipy is imported in the functions that use it: every parse of the workflow imports this module (through the
# task registry), and only tree tops need scipy (0.3 s of each parse and job start)
LOGGER = logging.getLogger(__name__)

LAYER = "tree_tops"
TREE_TOPS_NEED = "tree tops need points (one per tree)"
PLATEAU_MARGIN = 16  # pixels of halo beyond the largest window radius, for plateaus that cross a block's edge
CHUNK_ELEMENTS = 1 << 22  # survivors × offsets compared at once (32 MiB of float64)
EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)


@dataclass(frozen=True)
class TreeTopRule:
    """Which pixels are tree tops: at least ``min_height`` metres high and the highest of their window, a disc of
    diameter ``intercept + slope * height`` metres clipped to ``[min_diameter, max_diameter]``."""

    min_height: float
    intercept: float = 3.0
    slope: float = 0.1
    min_diameter: float = 3.0
    max_diameter: float = 10.0

    def __post_init__(self) -> None:
        for name in ("min_height", "intercept", "slope", "min_diameter", "max_diameter"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"tree top rule: {name} must be a finite number, got {getattr(self, name)!r}")
        if self.min_height <= 0:
            raise ValueError(f"tree top rule: min_height must be > 0 metres, got {self.min_height}")
        if self.slope < 0:
            raise ValueError(f"tree top rule: slope must be >= 0 (the window grows with height), got {self.slope}")
        if self.min_diameter <= 0:
            raise ValueError(f"tree top rule: min_diameter must be > 0 metres, got {self.min_diameter}")
        if self.max_diameter < self.min_diameter:
            raise ValueError(
                f"tree top rule: max_diameter ({self.max_diameter}) must be >= min_diameter ({self.min_diameter})"
            )

    def diameter(self, height: np.ndarray) -> np.ndarray:
        """The window's diameter in metres at each height."""
        diameter = self.intercept + self.slope * np.asarray(height, dtype=np.float64)
        return np.clip(diameter, self.min_diameter, self.max_diameter)

    def radius_px(self, height: np.ndarray, pixel_size: float) -> np.ndarray:
        """The window's radius R in whole pixels (at least 1) at each height."""
        return _radius_px(self.diameter(height), pixel_size)

    def max_radius_px(self, pixel_size: float) -> int:
        """The largest radius any height gets: a block's halo."""
        return int(_radius_px(np.array([self.max_diameter]), pixel_size)[0])


def _radius_px(diameter: np.ndarray, pixel_size: float) -> np.ndarray:
    if not pixel_size > 0:
        raise ValueError(f"pixel size must be > 0 metres, got {pixel_size}")
    return np.maximum(1, np.floor(diameter / (2 * pixel_size) + 0.5)).astype(np.int64)


def _inscribed_half_side(radius: int) -> int:
    """The half side s of the largest square (2s + 1 pixels) inside the window of radius R: 2 s² <= R (R + 1)."""
    return max(1, math.isqrt(radius * (radius + 1) // 2))


def _disc_offsets(radius: int, inside: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dy, dx, dy² + dx²) of the window of radius ``radius`` outside the square of half side ``inside``, nearest
    first (a survivor mostly loses to a near pixel)."""
    dy, dx = np.mgrid[-radius : radius + 1, -radius : radius + 1]
    d2 = dy * dy + dx * dx
    keep = (d2 <= radius * (radius + 1)) & (np.maximum(abs(dy), abs(dx)) > inside)
    order = np.argsort(d2[keep], kind="stable")
    return dy[keep][order], dx[keep][order], d2[keep][order]


def prepared_heights(height: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """The heights as float64 with every invalid pixel (``valid`` false, NaN, ±inf) at -inf: never a top, never a
    window's winner."""
    heights = np.asarray(height, dtype=np.float64).copy()
    invalid = ~np.isfinite(heights)
    if valid is not None:
        invalid |= ~np.asarray(valid, dtype=bool)
    heights[invalid] = -np.inf
    return heights


def window_maxima(heights: np.ndarray, pixel_size: float, rule: TreeTopRule) -> np.ndarray:
    """The mask of pixels at least ``rule.min_height`` high that no pixel of their own window exceeds (ties
    included: plateaus are resolved by :func:`plateau_tops`). ``heights`` as from :func:`prepared_heights`;
    pixels beyond the array's edge do not exist."""
    from scipy import ndimage

    eligible = heights >= rule.min_height
    if not eligible.any():
        return eligible
    radius = np.zeros(heights.shape, dtype=np.int64)
    radius[eligible] = rule.radius_px(heights[eligible], pixel_size)
    inside = _inscribed_half_side(int(radius[eligible].min()))
    square = ndimage.maximum_filter(heights, size=2 * inside + 1, mode="constant", cval=-np.inf)
    rows, cols = np.nonzero(eligible & (heights >= square))
    alive = _survive_discs(heights, rows, cols, radius[rows, cols], inside)
    mask = np.zeros(heights.shape, dtype=bool)
    mask[rows[alive], cols[alive]] = True
    return mask


def _survive_discs(
    heights: np.ndarray, rows: np.ndarray, cols: np.ndarray, radius: np.ndarray, inside: int
) -> np.ndarray:
    """Which survivors (rows, cols, their radii) no pixel of their disc beyond the checked square exceeds."""
    alive = np.ones(rows.size, dtype=bool)
    if rows.size == 0:
        return alive
    reach = int(radius.max())
    padded = np.pad(heights, reach, constant_values=-np.inf)
    dy, dx, d2 = _disc_offsets(reach, inside)
    limit = radius * (radius + 1)
    todo = np.arange(rows.size)
    start = 0
    while start < d2.size and todo.size:
        stop = start + max(1, CHUNK_ELEMENTS // todo.size)
        r, c, v = rows[todo] + reach, cols[todo] + reach, heights[rows[todo], cols[todo]]
        neighbours = padded[r[:, None] + dy[None, start:stop], c[:, None] + dx[None, start:stop]]
        within = limit[todo, None] >= d2[None, start:stop]
        beaten = ((neighbours > v[:, None]) & within).any(axis=1)
        alive[todo[beaten]] = False
        todo = todo[~beaten & (limit[todo] >= d2[min(stop, d2.size - 1)])]  # beaten, or its whole disc checked
        start = stop
    return alive


def plateau_tops(candidates: np.ndarray, row0: int = 0, col0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One pixel (local rows, cols) per 8-connected group of candidates: the one nearest the group's centroid, ties
    by row then column, measured in raster pixel coordinates (the array's pixel (0, 0) is the raster's (row0,
    col0)) so that the choice depends on the group alone, not on where the array was cut. Touching candidates are
    each in the other's window, hence tied: a group is a plateau."""
    from scipy import ndimage

    labels, count = ndimage.label(candidates, structure=EIGHT_CONNECTED)
    rows, cols = np.nonzero(labels)
    if count == 0:
        return rows, cols
    group = labels[rows, cols]
    grows, gcols = (rows + row0).astype(np.float64), (cols + col0).astype(np.float64)
    size = np.bincount(group, minlength=count + 1)[group]
    centre_r = np.bincount(group, weights=grows, minlength=count + 1)[group] / size
    centre_c = np.bincount(group, weights=gcols, minlength=count + 1)[group] / size
    distance = (grows - centre_r) ** 2 + (gcols - centre_c) ** 2
    order = np.lexsort((cols, rows, distance, group))
    first = order[np.r_[True, group[order][1:] != group[order][:-1]]]
    return rows[first], cols[first]


def local_maxima(
    height: np.ndarray, valid: np.ndarray | None, pixel_size: float, rule: TreeTopRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tree tops of a whole height array (its edges are the raster's): (rows, cols, heights), sorted by row
    then column. ``valid``: false where a pixel has no data (NaN counts as no data too)."""
    heights = prepared_heights(height, valid)
    rows, cols = plateau_tops(window_maxima(heights, pixel_size, rule))
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    return rows, cols, heights[rows, cols]


@dataclass(frozen=True)
class Block:
    """A block's core and its haloed window, in raster pixels."""

    row: int
    col: int
    height: int
    width: int

    def haloed(self, halo: int, shape: tuple[int, int]) -> Window:
        row_off, col_off = max(0, self.row - halo), max(0, self.col - halo)
        row_end = min(shape[0], self.row + self.height + halo)
        col_end = min(shape[1], self.col + self.width + halo)
        return Window(col_off, row_off, col_end - col_off, row_end - row_off)


def blocks(shape: tuple[int, int], block: int) -> Iterator[Block]:
    for row in range(0, shape[0], block):
        for col in range(0, shape[1], block):
            yield Block(row, col, min(block, shape[0] - row), min(block, shape[1] - col))


def _unreliable(window: Window, shape: tuple[int, int], reach: int) -> np.ndarray:
    """The pixels of a haloed window whose own window may cross a cut side (not the raster's edge): their maxima
    may be wrong (a superset)."""
    height, width = int(window.height), int(window.width)
    row_off, col_off = int(window.row_off), int(window.col_off)
    band = np.zeros((height, width), dtype=bool)
    if row_off > 0:
        band[:reach] = True
    if row_off + height < shape[0]:
        band[height - reach :] = True
    if col_off > 0:
        band[:, :reach] = True
    if col_off + width < shape[1]:
        band[:, width - reach :] = True
    return band


def _core_mask(core: Block, window: Window) -> np.ndarray:
    mask = np.zeros((int(window.height), int(window.width)), dtype=bool)
    top, left = core.row - int(window.row_off), core.col - int(window.col_off)
    mask[top : top + core.height, left : left + core.width] = True
    return mask


def _read_heights(src: rasterio.io.DatasetReader, window: Window) -> np.ndarray:
    """Band 1 of a window as float64, -inf where the dataset's mask (nodata value, mask band, alpha) or NaN says
    there is no data."""
    return prepared_heights(src.read(1, window=window), src.read_masks(1, window=window) > 0)


def _block_tops(
    src: rasterio.io.DatasetReader, core: Block, pixel_size: float, rule: TreeTopRule, margin: int, cap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block's tops (raster rows, cols, heights): found on the core with its halo, kept in the core. The halo
    grows while a plateau holding a core pixel reaches pixels whose maxima the cut may have changed."""
    from scipy import ndimage

    shape, reach = (src.height, src.width), rule.max_radius_px(pixel_size)
    while True:
        window = core.haloed(reach + margin, shape)
        heights = _read_heights(src, window)
        candidates = window_maxima(heights, pixel_size, rule)
        labels, _ = ndimage.label(candidates, structure=EIGHT_CONNECTED)
        core_mask = _core_mask(core, window)
        cut = np.intersect1d(labels[core_mask & candidates], labels[_unreliable(window, shape, reach) & candidates])
        if cut.size == 0 or margin >= cap:
            break
        margin *= 2
    if cut.size:
        LOGGER.warning(
            "%s: %d plateau(s) of tied heights wider than the halo at rows %d-%d, cols %d-%d: each may give one "
            "top per block it crosses",
            shown(src.name),
            cut.size,
            core.row,
            core.row + core.height,
            core.col,
            core.col + core.width,
        )
    rows, cols = plateau_tops(candidates, int(window.row_off), int(window.col_off))
    keep = core_mask[rows, cols]
    rows, cols = rows[keep], cols[keep]
    return rows + int(window.row_off), cols + int(window.col_off), heights[rows, cols]


def find_tree_tops(
    raster: str | Path, rule: TreeTopRule, block: int = 2048, *, plateau_margin: int = PLATEAU_MARGIN
) -> gpd.GeoDataFrame:
    """The tree tops of band 1 of a height raster (GeoTIFF, COG, VRT mosaic; local or remote), read ``block`` ×
    ``block`` pixels at a time with a halo: points at pixel centres in the raster's CRS with their ``height``,
    sorted by row then column (north to south, west to east on a north-up raster). The same points whatever
    ``block`` (see the module's note on plateaus wider than ``plateau_margin``, which grows up to half a block)."""
    if block < 1 or plateau_margin < 1:
        raise ValueError(f"block and plateau_margin must be >= 1 pixel, got {block} and {plateau_margin}")
    with open_raster(raster) as src:
        pixel_size = square_pixel_size(src)
        found = [
            _block_tops(src, core, pixel_size, rule, plateau_margin, max(plateau_margin, block // 2))
            for core in blocks((src.height, src.width), block)
        ]
        transform, crs = src.transform, src.crs
    rows, cols, heights = (np.concatenate(part) for part in zip(*found, strict=True))
    order = np.lexsort((cols, rows))
    return tops_frame(rows[order], cols[order], heights[order], transform, crs)


def tops_frame(
    rows: np.ndarray, cols: np.ndarray, heights: np.ndarray, transform: Affine, crs: object
) -> gpd.GeoDataFrame:
    """Tops (raster rows, cols, heights) as points at their pixels' centres."""
    if rows.size:
        xs, ys = xy(transform, rows, cols, offset="center")
    else:
        xs, ys = np.array([]), np.array([])
    points = gpd.points_from_xy(np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64))
    return gpd.GeoDataFrame({"height": np.asarray(heights, dtype=np.float64)}, geometry=points, crs=crs)


def write_tree_tops(frame: gpd.GeoDataFrame, gpkg_path: str | Path, parquet_path: str | Path) -> None:
    """Write tree tops as a GeoPackage (layer ``tree_tops``) and a GeoParquet, each atomically."""
    write_gpkg(frame, gpkg_path, LAYER)
    write_geoparquet(frame, parquet_path)


def _points(frame: gpd.GeoDataFrame) -> np.ndarray:
    """(n, 2) coordinates of a frame's non-empty point geometries."""
    geometry = frame.geometry
    geometry = geometry[~(geometry.isna() | geometry.is_empty)]
    if geometry.size and not (geometry.geom_type == "Point").all():
        raise ValueError("tree tops must be points")
    return np.column_stack([geometry.x.to_numpy(dtype=np.float64), geometry.y.to_numpy(dtype=np.float64)])


def _in_crs_of(truth: gpd.GeoDataFrame, predicted: gpd.GeoDataFrame) -> gpd.GeoDataFrame:
    if predicted.crs is None and truth.crs is None:
        return truth
    if predicted.crs is None or truth.crs is None:
        raise ValueError("tree tops: one of predicted and true tops has no CRS; both need one to be compared")
    return truth if truth.crs == predicted.crs else truth.to_crs(predicted.crs)


def score_tree_tops(
    predicted: gpd.GeoDataFrame, truth: gpd.GeoDataFrame, max_distance: float = 1.0
) -> dict[str, float | int | None]:
    """Precision, recall and F1 of predicted tops against true tops (reprojected to the predicted's CRS) matched one
    to one within ``max_distance`` metres (:func:`match_points`). A ratio with nothing to count is 0;
    ``mean_distance_m`` is None when nothing matched."""
    if not max_distance > 0:
        raise ValueError(f"max_distance must be > 0, got {max_distance}")
    pred_xy, true_xy = _points(predicted), _points(_in_crs_of(truth, predicted))
    mp, mt = match_points(pred_xy, true_xy, max_distance)
    matched = int(mp.size)
    precision = matched / len(pred_xy) if len(pred_xy) else 0.0
    recall = matched / len(true_xy) if len(true_xy) else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    distances = np.hypot(*(pred_xy[mp] - true_xy[mt]).T) if matched else None
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "matched": matched,
        "predicted": len(pred_xy),
        "true": len(true_xy),
        "mean_distance_m": float(distances.mean()) if distances is not None else None,
    }


def read_tree_tops(path: str | Path) -> gpd.GeoDataFrame:
    """Tree tops from any OGR file (or GeoParquet) of points in a CRS; one line naming the file and the first
    feature that is missing or no point (:func:`rasterscale.raster.geometry_checks.check_points`), or saying it has
    no CRS (tops are matched in the predicted tops' CRS). The dry run's check of ``scenes.X.tree_tops``, and the
    scoring's read."""
    frame, names = read_features(str(path), TREE_TOPS_NEED)
    check_points(str(path), frame.geometry.to_numpy(), names, TREE_TOPS_NEED)
    if frame.crs is None:
        raise InputError(
            f"{path}: tree tops have no CRS; they are reprojected to the height's CRS to be matched: set the CRS "
            "they were drawn in"
        )
    return frame.reset_index(drop=True)
