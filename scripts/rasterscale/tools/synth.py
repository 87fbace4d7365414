"""Synthetic demo scene: an RGB (optionally RGB + near-infrared) forest-canopy orthomosaic plus its ground truth.

The workflow's embedded demo data. One call to :func:`synthesize_scene` writes

* a 3-band uint8 RGB GeoTIFF (tiled, deflate) of textured ground with tree crowns on it; with ``nir``, a 4-band
  one whose 4th band is near infrared (band descriptions ``red, green, blue, nir``): crowns bright (vegetation
  reflects NIR strongly), ground dark, so NIR tells crowns from ground far better than any visible band, and
* a GeoPackage (layer ``crowns``) with one axis-aligned box per visible crown, labelled ``"tree"``, and
* optionally (``crowns_path``), a GeoPackage (layer ``crowns``) with the visible outline of every crown drawn, as
  polygons labelled ``"tree"`` (segmentation ground truth),
* optionally (``height_path``), the true canopy height: a float32 GeoTIFF on the same grid, in metres, 0 on the
  ground and a dome over each crown's visible pixels (the crown drawn on top owns a pixel, as in the outlines),
* optionally (``tops_path``), the true tree tops: a GeoPackage (layer ``tree_tops``) of points at the apex pixel
  (the highest point) of every crown whose apex is visible and inside the raster, with its ``height``.

The RGB raster, the boxes and the outlines are the same whichever of the optional outputs are asked for: the
optional outputs draw their random numbers from generators of their own (the outlines draw none).

Crowns vary in size, colour and outline; they are shaded as lumpy domes lit from the upper-left, cast a
shadow to the lower-right, and touch or partly overlap their neighbours (no crown is more than
``_MAX_HIDDEN`` covered by crowns drawn above it, so every labelled crown is visibly a crown). Everything is
drawn with numpy on each crown's local patch; the result depends only on the arguments (``seed`` included).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import geopandas as gpd
import numpy as np
import rasterio
import shapely
from rasterio.transform import Affine

from rasterscale.atomic import atomic_path
from rasterscale.raster.geo import pixel_boxes_to_polygons

__all__ = ["synthesize_scene"]

LAYER = "crowns"
LABEL = "tree"

# A crown may be covered by crowns above it by at most this fraction of its area, otherwise it is not drawn.
_MAX_HIDDEN = 0.4
# A crown cut by the raster edge is labelled only if at least this fraction of its box lies inside.
_MIN_INSIDE = 0.5
# Direction towards the sun, (x right, y down, z up): light from the upper-left, shadows to the lower-right.
_SUN = np.array([-0.55, -0.55, 0.63], dtype=np.float32) / np.float32(np.linalg.norm([-0.55, -0.55, 0.63]))

# Mid-tone crown colours (RGB) and how often each is drawn.
_CROWN_COLOURS = np.array(
    [
        [68, 108, 48],  # mid green
        [42, 78, 40],  # dark green
        [108, 134, 50],  # yellow-green
        [50, 94, 82],  # bluish green
        [84, 102, 52],  # olive
        [36, 66, 48],  # dark conifer green
    ],
    dtype=np.float32,
)
_CROWN_COLOUR_P = np.array([0.24, 0.18, 0.16, 0.15, 0.15, 0.12])

# Ground colours (RGB).
_GRASS = np.array([112, 118, 74], dtype=np.float32)
_DRY_GRASS = np.array([156, 144, 100], dtype=np.float32)
_SOIL = np.array([132, 108, 78], dtype=np.float32)
_DARK_SOIL = np.array([92, 80, 62], dtype=np.float32)
# Per-channel darkening of a full shadow (slightly bluish, as skylight fills shadows).
_SHADOW_TINT = np.array([1.0, 0.96, 0.82], dtype=np.float32)

_GROUND_ROWS = 128  # the ground is rendered in strips of this many rows to bound memory

# Near infrared. Ground: dark, green grass darkest, dry grass and soil a little brighter (mid-tones, before the
# ground texture); crowns: a per-crown mid-tone, shaded like the RGB but with less contrast (NIR light scatters
# through the foliage, so its shade is shallower). Shadows are a little darker in NIR than in the visible bands
# (the skylight that fills them has little NIR).
_NIR_GRASS = 52.0
_NIR_DRY_GRASS = 72.0
_NIR_SOIL = 70.0
_NIR_DARK_SOIL = 56.0
_NIR_CROWN = (170.0, 210.0)  # range of the crowns' mid-tones
_NIR_SHADE = (0.62, 0.4)  # NIR = mid-tone * (a + b * RGB shade)
_NIR_SHADOW_TINT = np.float32(1.05)
_BAND_NAMES = ("red", "green", "blue", "nir")

# Tree heights (metres): a crown's dome height, loosely growing with its diameter.
_CROWN_HEIGHT_M = (6.0, 30.0)
_HEIGHT_FROM_DIAMETER = 0.65  # weight of the diameter in the height; the rest is uniform noise

TOPS_LAYER = "tree_tops"

# Streams of the optional outputs, derived from ``seed`` so they never touch the main stream.
_NIR_STREAM = 1
_HEIGHT_STREAM = 2


class _Crown(NamedTuple):
    cx: float  # centre, pixel coordinates (x right, y down)
    cy: float
    radius: float  # outline scale (pixels): the outline is radius * (1 + sum of harmonics)
    reach: float  # largest distance from the centre to the outline (pixels)
    ks: np.ndarray  # outline harmonics: orders, amplitudes, phases
    amps: np.ndarray
    phases: np.ndarray
    colour: np.ndarray  # RGB mid-tone
    shadow_dx: float  # shadow offset (pixels, towards the lower-right)
    shadow_dy: float
    shadow_strength: float
    clump_cell: float  # size of foliage clumps (pixels)


def synthesize_scene(
    raster_path: str | Path,
    boxes_path: str | Path,
    *,
    width: int,
    height: int,
    seed: int,
    crs: str = "EPSG:32617",
    origin: tuple[float, float] = (404000.0, 3285000.0),
    pixel_size: float = 0.1,
    crown_diameter_m: tuple[float, float] = (2.5, 7.0),
    crown_cover: float = 0.35,
    block_size: int = 256,
    crowns_path: str | Path | None = None,
    nir: bool = False,
    height_path: str | Path | None = None,
    tops_path: str | Path | None = None,
) -> int:
    """Write a synthetic canopy orthomosaic and its crown boxes; return the number of crowns written.

    ``origin`` is the upper-left corner (x, y) in ``crs`` units, ``pixel_size`` the ground size of a pixel,
    ``crown_diameter_m`` the (min, max) crown box size in metres, ``crown_cover`` the approximate fraction
    of the scene covered by crowns. ``crowns_path``: also write the crowns' visible outlines (polygons) there.
    ``nir``: the raster gets a 4th band, near infrared. ``height_path``: also write the true canopy height
    (float32, metres) there; ``tops_path``: also write the true tree tops (points with their ``height``) there.
    Files are written atomically (temporary file, then rename).
    """
    _check_arguments(width, height, pixel_size, crown_diameter_m, crown_cover, block_size)
    transform = Affine(pixel_size, 0.0, origin[0], 0.0, -pixel_size, origin[1])  # north-up
    canvas, drawn, pixel_boxes = _paint_scene(seed, width, height, pixel_size, crown_diameter_m, crown_cover, nir)
    _write_raster(Path(raster_path), canvas, crs, transform, block_size)
    _write_boxes(Path(boxes_path), pixel_boxes, crs, transform)
    if crowns_path is not None:
        _write_crown_polygons(Path(crowns_path), _visible_outlines(drawn, width, height), crs, transform)
    if height_path is not None or tops_path is not None:
        tree_heights = _tree_heights(np.random.default_rng([seed, _HEIGHT_STREAM]), drawn, pixel_size, crown_diameter_m)
        canopy, tops = _paint_canopy_height(drawn, tree_heights, width, height)
        if height_path is not None:
            _write_height(Path(height_path), canopy, crs, transform, block_size)
        if tops_path is not None:
            _write_tops(Path(tops_path), tops, crs, transform)
    return len(pixel_boxes)


def _check_arguments(
    width: int,
    height: int,
    pixel_size: float,
    crown_diameter_m: tuple[float, float],
    crown_cover: float,
    block_size: int,
) -> None:
    """:func:`synthesize_scene`'s arguments that would draw no scene, or a broken one, raise ValueError."""
    if width < 1 or height < 1:
        raise ValueError(f"width and height must be positive, got {width} x {height}")
    if block_size < 16 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
    if pixel_size <= 0:
        raise ValueError(f"pixel_size must be positive, got {pixel_size}")
    d_min, d_max = crown_diameter_m
    if not 0 < d_min <= d_max:
        raise ValueError(f"crown_diameter_m must satisfy 0 < min <= max, got {crown_diameter_m}")
    if not 0 < crown_cover < 1:
        raise ValueError(f"crown_cover must be in (0, 1), got {crown_cover}")


def _paint_scene(
    seed: int,
    width: int,
    height: int,
    pixel_size: float,
    crown_diameter_m: tuple[float, float],
    crown_cover: float,
    nir: bool,
) -> tuple[np.ndarray, list[_Crown], list[tuple[int, int, int, int]]]:
    """The scene's pixels (3 or, with ``nir``, 4 bands), the crowns drawn (bottom to top) and the pixel boxes
    (c0, r0, c1, r1) of those labelled: ground, then each crown's shadow and crown."""
    rng = np.random.default_rng(seed)
    nir_rng = np.random.default_rng([seed, _NIR_STREAM]) if nir else None
    canvas = np.empty((4 if nir else 3, height, width), dtype=np.uint8)
    _render_ground(rng, canvas, pixel_size, nir_rng)
    crowns = _place_crowns(rng, width, height, pixel_size, crown_diameter_m, crown_cover)
    drawn, pixel_boxes = _resolve_occlusion(rng, crowns, width, height)
    nir_levels = nir_rng.uniform(*_NIR_CROWN, size=len(drawn)) if nir_rng is not None else [None] * len(drawn)
    for crown, nir_level in zip(drawn, nir_levels, strict=True):  # bottom to top
        _draw_shadow(canvas, crown)
        _draw_crown(rng, canvas, crown, nir_level)
    return canvas, drawn, pixel_boxes


# --------------------------------------------------------------------------------------------- noise


_NoisePlan = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _noise_axis(n: int, cell: float, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Lattice index and smoothstep weight of each of ``n`` pixel centres along one axis."""
    pos = (np.arange(n, dtype=np.float32) + np.float32(0.5)) / np.float32(cell) + np.float32(offset)
    floor = np.floor(pos)
    f = pos - floor
    return floor.astype(np.intp), f * f * (3 - 2 * f)


def _plan_noise(rng: np.random.Generator, height: int, width: int, cell: float) -> _NoisePlan:
    """Random lattice (spacing ``cell`` pixels) of a smooth value-noise field, and where pixels fall in it."""
    cell = max(cell, 1.0)
    iy, fy = _noise_axis(height, cell, float(rng.random()))
    ix, fx = _noise_axis(width, cell, float(rng.random()))
    lattice = rng.standard_normal((int(iy[-1]) + 2, int(ix[-1]) + 2), dtype=np.float32)
    return lattice, iy, fy, ix, fx


def _noise_rows(plan: _NoisePlan, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0:r1`` of a planned noise field (std ~0.6); only the lattice rows needed are interpolated."""
    lattice, iy, fy, ix, fx = plan
    i, f = iy[r0:r1], fy[r0:r1, None]
    lo = int(i[0])
    rows = lattice[lo : int(i[-1]) + 2]
    along_x = rows[:, ix] * (1 - fx) + rows[:, ix + 1] * fx
    i = i - lo
    return along_x[i] * (1 - f) + along_x[i + 1] * f


def _fbm_rows(octaves: list[tuple[_NoisePlan, float]], r0: int, r1: int) -> np.ndarray:
    """Weighted sum of several planned noise fields, rows ``r0:r1``."""
    total = None
    for plan, weight in octaves:
        part = _noise_rows(plan, r0, r1) * np.float32(weight)
        total = part if total is None else total + part
    assert total is not None
    return total


def _fbm(rng: np.random.Generator, height: int, width: int, cells: list[tuple[float, float]]) -> np.ndarray:
    """A small multi-scale noise field (for crown patches); ``cells`` is a list of (cell, weight)."""
    octaves = [(_plan_noise(rng, height, width, cell), weight) for cell, weight in cells]
    return _fbm_rows(octaves, 0, height)


def _clump_field(rng: np.random.Generator, height: int, width: int, cell: float) -> np.ndarray:
    """Rounded bumps, one per ``cell`` x ``cell`` pixels at a jittered spot: 1 at a bump's top, ~0 between.

    Cellular (Worley) noise: each pixel looks for the nearest bump centre in its 3 x 3 neighbouring cells.
    """
    cell = max(cell, 1.5)
    py = (np.arange(height, dtype=np.float32) + np.float32(0.5)) / np.float32(cell)
    px = (np.arange(width, dtype=np.float32) + np.float32(0.5)) / np.float32(cell)
    iy, ix = np.floor(py), np.floor(px)
    fy, fx = (py - iy)[:, None], (px - ix)[None, :]  # position inside the pixel's own cell
    iy, ix = iy.astype(np.intp)[:, None], ix.astype(np.intp)[None, :]
    jitter = rng.random((2, int(iy[-1, 0]) + 3, int(ix[0, -1]) + 3), dtype=np.float32)
    nearest = np.full((height, width), np.inf, dtype=np.float32)
    for oy in (0, 1, 2):
        for ox in (0, 1, 2):
            ddy = fy - (oy - 1) - jitter[0, iy + oy, ix + ox]
            ddx = fx - (ox - 1) - jitter[1, iy + oy, ix + ox]
            np.minimum(nearest, ddy * ddy + ddx * ddx, out=nearest)
    return np.clip(1 - 1.6 * nearest, 0, 1)


# --------------------------------------------------------------------------------------------- ground


def _render_ground(
    rng: np.random.Generator, canvas: np.ndarray, pixel_size: float, nir_rng: np.random.Generator | None
) -> None:
    """Fill ``canvas`` (3 or 4, H, W) with grass and soil: patchy low-frequency colour plus fine texture.

    A 4th (NIR) band follows the same grass / soil fields and texture; its own noise comes from ``nir_rng``.
    """
    _, height, width = canvas.shape

    def octaves(cells_m: list[tuple[float, float]]) -> list[tuple[_NoisePlan, float]]:
        return [(_plan_noise(rng, height, width, c / pixel_size), w) for c, w in cells_m]

    grass_field = octaves([(30.0, 1.0), (9.0, 0.5), (2.5, 0.2)])
    dry_field = octaves([(18.0, 1.0), (5.0, 0.5), (0.8, 0.25)])
    dark_field = octaves([(12.0, 1.0), (3.0, 0.5)])
    bright_field = octaves([(4.0, 0.5), (1.0, 0.35), (0.3, 0.3)])

    for r0 in range(0, height, _GROUND_ROWS):
        r1 = min(r0 + _GROUND_ROWS, height)
        grass_w = np.clip(0.6 + 1.1 * _fbm_rows(grass_field, r0, r1), 0, 1)
        dry_w = np.clip(0.45 + 1.1 * _fbm_rows(dry_field, r0, r1), 0, 1)
        dark_w = np.clip(0.5 + 1.2 * _fbm_rows(dark_field, r0, r1), 0, 1)
        grass = _GRASS[:, None, None] + (_DRY_GRASS - _GRASS)[:, None, None] * dry_w
        soil = _SOIL[:, None, None] + (_DARK_SOIL - _SOIL)[:, None, None] * dark_w
        colour = soil + (grass - soil) * grass_w
        fine = rng.standard_normal((r1 - r0, width), dtype=np.float32)
        texture = 1 + 0.14 * _fbm_rows(bright_field, r0, r1) + 0.06 * fine
        colour *= texture
        colour += 3.0 * rng.standard_normal(colour.shape, dtype=np.float32)
        canvas[:3, r0:r1] = np.clip(colour + 0.5, 0, 255).astype(np.uint8)
        if nir_rng is not None:
            canvas[3, r0:r1] = _ground_nir(nir_rng, grass_w, dry_w, dark_w, texture)


def _ground_nir(
    nir_rng: np.random.Generator, grass_w: np.ndarray, dry_w: np.ndarray, dark_w: np.ndarray, texture: np.ndarray
) -> np.ndarray:
    """NIR of a strip of ground (uint8), from the weights and texture its RGB is made of: dark, and darkest on
    green grass."""
    grass = np.float32(_NIR_GRASS) + np.float32(_NIR_DRY_GRASS - _NIR_GRASS) * dry_w
    soil = np.float32(_NIR_SOIL) + np.float32(_NIR_DARK_SOIL - _NIR_SOIL) * dark_w
    value = (soil + (grass - soil) * grass_w) * texture
    value += 2.5 * nir_rng.standard_normal(value.shape, dtype=np.float32)
    return np.clip(value + 0.5, 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------------------------- crowns


def _place_crowns(
    rng: np.random.Generator,
    width: int,
    height: int,
    pixel_size: float,
    diameter_m: tuple[float, float],
    cover: float,
) -> list[_Crown]:
    """Random crown positions until ``cover`` of the raster is covered (as discs, on a coarse grid).

    Half of the crowns start free (uniformly, possibly straddling the edge), half join a recent crown,
    which grows touching groups. A candidate is rejected when its centre is closer to an existing one than
    0.6-0.9 x the sum of the radii, or than the larger radius plus a quarter of the smaller one.
    """
    d_min, d_max = (d / pixel_size for d in diameter_m)
    cell = 4  # coverage grid cell (pixels)
    covered = np.zeros((math.ceil(height / cell), math.ceil(width / cell)), dtype=bool)
    target = cover * covered.size
    n_covered = 0
    mean_area = math.pi * ((d_min + d_max) / 4) ** 2
    expected = max(1, int(cover * width * height / mean_area))
    capacity = 2 * expected + 16
    xs, ys, rs = (np.empty(capacity) for _ in range(3))
    crowns: list[_Crown] = []
    attempts, max_attempts = 0, 200 + 60 * expected
    while n_covered < target and attempts < max_attempts:
        attempts += 1
        diameter = rng.uniform(d_min, d_max)
        r = diameter / 2
        n = len(crowns)
        if n and rng.random() < 0.5:
            j = n - 1 - int(rng.integers(min(n, 6)))
            angle = rng.uniform(0, 2 * math.pi)
            dist = (rs[j] + r) * rng.uniform(0.65, 0.95)
            x, y = xs[j] + dist * math.cos(angle), ys[j] + dist * math.sin(angle)
            if not (-0.5 * r < x < width + 0.5 * r and -0.5 * r < y < height + 0.5 * r):
                continue
        else:
            x, y = rng.uniform(-0.5 * r, width + 0.5 * r), rng.uniform(-0.5 * r, height + 0.5 * r)
        if n:
            dist = np.hypot(xs[:n] - x, ys[:n] - y)
            near = np.minimum(rs[:n], r)
            if np.any(dist < rng.uniform(0.6, 0.9) * (rs[:n] + r)) or np.any(
                dist < np.maximum(rs[:n], r) + 0.25 * near
            ):
                continue
        if n == capacity:
            capacity *= 2
            xs, ys, rs = (np.resize(a, capacity) for a in (xs, ys, rs))
        xs[n], ys[n], rs[n] = x, y, r
        crowns.append(_make_crown(rng, x, y, diameter, (d_min, d_max)))
        n_covered += _stamp_disc(covered, x / cell, y / cell, 0.95 * r / cell)
    return crowns


def _stamp_disc(grid: np.ndarray, x: float, y: float, r: float) -> int:
    """Mark a disc (grid-cell units) in a boolean grid; return how many cells were newly marked."""
    r0, r1 = max(int(y - r), 0), min(int(y + r) + 1, grid.shape[0])
    c0, c1 = max(int(x - r), 0), min(int(x + r) + 1, grid.shape[1])
    if r0 >= r1 or c0 >= c1:
        return 0
    yy = np.arange(r0, r1)[:, None] + 0.5 - y
    xx = np.arange(c0, c1)[None, :] + 0.5 - x
    disc = xx * xx + yy * yy <= r * r
    patch = grid[r0:r1, c0:c1]
    new = int(np.count_nonzero(disc & ~patch))
    patch |= disc
    return new


def _make_crown(rng: np.random.Generator, x: float, y: float, diameter: float, d_range: tuple[float, float]) -> _Crown:
    """Random outline, colour and shadow for a crown whose box is about ``diameter`` pixels across."""
    # Low orders make the crown lopsided or oval; high orders make a leafy, lumpy rim.
    ks = np.concatenate([[2, 3, 4, 5], rng.integers(6, 19, size=6)]).astype(np.float32)
    amps = np.concatenate([rng.uniform(0, [0.10, 0.07, 0.05, 0.035]), rng.uniform(0, 0.022, size=6)]).astype(np.float32)
    phases = rng.uniform(0, 2 * math.pi, size=ks.size).astype(np.float32)
    theta = np.linspace(0, 2 * math.pi, 1440, endpoint=False, dtype=np.float32)
    profile = _profile(theta, ks, amps, phases)
    box_w = float(np.ptp(profile * np.cos(theta)))
    box_h = float(np.ptp(profile * np.sin(theta)))
    # Scale so the box's mean side is the drawn diameter, but keep both sides within the allowed range.
    scale = diameter / ((box_w + box_h) / 2)
    scale = min(max(scale, d_range[0] / min(box_w, box_h)), d_range[1] / max(box_w, box_h))

    colour = _CROWN_COLOURS[rng.choice(len(_CROWN_COLOURS), p=_CROWN_COLOUR_P)]
    colour = colour * rng.uniform(0.85, 1.15) + rng.normal(0, 5, size=3)
    shadow = scale * rng.uniform(0.35, 0.6)
    return _Crown(
        cx=x,
        cy=y,
        radius=scale,
        reach=scale * float(profile.max()),
        ks=ks,
        amps=amps,
        phases=phases,
        colour=colour.astype(np.float32),
        shadow_dx=shadow * rng.uniform(0.85, 1.15),
        shadow_dy=shadow * rng.uniform(0.85, 1.15),
        shadow_strength=float(rng.uniform(0.45, 0.6)),
        clump_cell=max(2.5, scale * rng.uniform(0.18, 0.3)),
    )


def _profile(theta: np.ndarray, ks: np.ndarray, amps: np.ndarray, phases: np.ndarray) -> np.ndarray:
    """Relative outline radius ``1 + sum(a * cos(k * theta + phase))`` at each angle."""
    waves = np.cos(ks.reshape(-1, *([1] * theta.ndim)) * theta + phases.reshape(-1, *([1] * theta.ndim)))
    return 1 + np.tensordot(amps, waves, axes=1)


def _local_grid(
    cx: float, cy: float, half: float, width: int, height: int, *, clip: bool
) -> tuple[int, int, int, int, np.ndarray, np.ndarray]:
    """Pixel window around (cx, cy) and the offsets of its pixel centres from it: r0, r1, c0, c1, dx, dy."""
    r0, r1 = math.floor(cy - half), math.ceil(cy + half) + 1
    c0, c1 = math.floor(cx - half), math.ceil(cx + half) + 1
    if clip:
        r0, r1, c0, c1 = max(r0, 0), min(r1, height), max(c0, 0), min(c1, width)
    dx = np.arange(c0, c1, dtype=np.float32)[None, :] + np.float32(0.5 - cx)
    dy = np.arange(r0, r1, dtype=np.float32)[:, None] + np.float32(0.5 - cy)
    return r0, r1, c0, c1, dx, dy


def _outline(crown: _Crown, dx: np.ndarray, dy: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, ...]:
    """Distance of each pixel from the centre and the outline radius in its direction (pixels)."""
    rho = np.hypot(dx, dy)
    edge = np.float32(crown.radius * scale) * _profile(np.arctan2(dy, dx), crown.ks, crown.amps, crown.phases)
    return rho, edge


def _resolve_occlusion(
    rng: np.random.Generator, crowns: list[_Crown], width: int, height: int
) -> tuple[list[_Crown], list[tuple[int, int, int, int]]]:
    """Pick a random height order and drop crowns hidden too much by higher ones.

    Returns the crowns to draw, bottom to top, and the pixel boxes (c0, r0, c1, r1) of those to label.
    """
    order = rng.permutation(len(crowns))
    occupied = np.zeros((height, width), dtype=bool)
    kept: list[tuple[_Crown, tuple[int, int, int, int] | None]] = []
    for index in order[::-1]:  # top to bottom
        crown = crowns[index]
        r0, r1, c0, c1, dx, dy = _local_grid(crown.cx, crown.cy, crown.reach + 1, width, height, clip=False)
        rho, edge = _outline(crown, dx, dy)
        mask = rho <= edge
        rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
        if rows.size == 0:
            continue
        ir0, ir1, ic0, ic1 = max(r0, 0), min(r1, height), max(c0, 0), min(c1, width)
        if ir0 >= ir1 or ic0 >= ic1:
            continue
        inside = mask[ir0 - r0 : ir1 - r0, ic0 - c0 : ic1 - c0]
        visible = np.count_nonzero(inside)
        below = occupied[ir0:ir1, ic0:ic1]
        if visible == 0 or np.count_nonzero(below & inside) > _MAX_HIDDEN * visible:
            continue
        below |= inside
        full = (c0 + int(cols[0]), r0 + int(rows[0]), c0 + int(cols[-1]) + 1, r0 + int(rows[-1]) + 1)
        clipped = (max(full[0], 0), max(full[1], 0), min(full[2], width), min(full[3], height))
        area = (full[2] - full[0]) * (full[3] - full[1])
        kept_area = (clipped[2] - clipped[0]) * (clipped[3] - clipped[1])
        kept.append((crown, clipped if kept_area >= _MIN_INSIDE * area else None))
    kept.reverse()
    return [crown for crown, _ in kept], [b for _, b in kept if b is not None]


def _draw_shadow(canvas: np.ndarray, crown: _Crown) -> None:
    """Darken the crown's soft-edged cast shadow (its outline, shifted to the lower-right) on the canvas."""
    _, height, width = canvas.shape
    soft = 0.12 * crown.radius + 1.5
    cx, cy = crown.cx + crown.shadow_dx, crown.cy + crown.shadow_dy
    r0, r1, c0, c1, dx, dy = _local_grid(cx, cy, 1.05 * crown.reach + soft, width, height, clip=True)
    if r0 >= r1 or c0 >= c1:
        return
    rho, edge = _outline(crown, dx, dy, scale=1.05)
    alpha = np.clip(0.5 + (edge - rho) / np.float32(soft), 0, 1) * np.float32(crown.shadow_strength)
    patch = canvas[:, r0:r1, c0:c1]
    tint = _SHADOW_TINT if len(canvas) == 3 else np.append(_SHADOW_TINT, _NIR_SHADOW_TINT)
    darkened = patch * (1 - tint[:, None, None] * alpha)
    patch[...] = np.clip(darkened + 0.5, 0, 255).astype(np.uint8)


def _crown_window(crown: _Crown, width: int, height: int) -> tuple[int, int, int, int, np.ndarray, np.ndarray] | None:
    """The clipped pixel window :func:`_draw_crown` paints the crown in (see :func:`_local_grid`), or None where
    it paints nothing (less than 2 x 2 pixels of it inside the raster)."""
    r0, r1, c0, c1, dx, dy = _local_grid(crown.cx, crown.cy, crown.reach + 2, width, height, clip=True)
    if r1 - r0 < 2 or c1 - c0 < 2:
        return None
    return r0, r1, c0, c1, dx, dy


def _draw_crown(rng: np.random.Generator, canvas: np.ndarray, crown: _Crown, nir_level: float | None) -> None:
    """Paint one crown: a lumpy dome of foliage clumps, lit from the upper-left, with an anti-aliased rim.

    With a 4th (NIR) band, ``nir_level`` is the crown's NIR mid-tone; NIR is shaded like the RGB, more softly.
    """
    _, height, width = canvas.shape
    window = _crown_window(crown, width, height)
    if window is None:
        return
    r0, r1, c0, c1, dx, dy = window
    rho, edge = _outline(crown, dx, dy)
    alpha = np.clip(0.5 + (edge - rho) / np.float32(1.2), 0, 1)
    if not alpha.any():
        return
    rn = rho / edge
    dome = np.sqrt(np.clip(1 - rn * rn, 0, 1))
    cell = crown.clump_cell
    clumps = _clump_field(rng, r1 - r0, c1 - c0, cell)
    fine = _fbm(rng, r1 - r0, c1 - c0, [(cell / 3, 1.0), (1.5, 0.5)])
    # Height field in pixels: the dome plus rounded foliage clumps; its slopes decide the sunlight.
    bumps = clumps * np.float32(0.7 * cell) + fine * np.float32(0.12 * cell)
    surface = np.float32(0.6 * crown.radius) * dome + bumps * np.sqrt(dome + 0.2)
    gy, gx = np.gradient(surface)
    lit = np.clip((_SUN[2] - _SUN[0] * gx - _SUN[1] * gy) / np.sqrt(1 + gx * gx + gy * gy), 0, 1)
    # Whole-crown sun side: brighter towards the upper-left of the crown, darker to the lower-right.
    side = 1 + 0.3 * (_SUN[0] * dx + _SUN[1] * dy) / (np.float32(crown.radius) * np.hypot(_SUN[0], _SUN[1]))
    cavity = np.clip(0.55 + 0.55 * clumps, 0.45, 1.1)  # darker gaps between clumps
    noise = 1 + 0.06 * rng.standard_normal(rho.shape, dtype=np.float32)
    shade = (0.2 + 0.95 * lit) * side * cavity * noise
    warm = lit * lit  # sunlit foliage a little yellower, shaded foliage a little bluer
    tint = np.stack([1 + 0.10 * warm, 1 + 0.06 * warm, 0.92 + 0.08 * (1 - warm)])
    colour = crown.colour[:, None, None] * shade * tint
    if nir_level is not None:
        a, b = _NIR_SHADE
        colour = np.concatenate([colour, (np.float32(nir_level) * (a + b * shade))[None]])
    patch = canvas[:, r0:r1, c0:c1]
    blended = patch + alpha * (colour - patch)
    patch[...] = np.clip(blended + 0.5, 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------------------------- height


class _Top(NamedTuple):
    row: int  # apex pixel
    col: int
    height: float  # metres


def _tree_heights(
    rng: np.random.Generator, drawn: list[_Crown], pixel_size: float, diameter_m: tuple[float, float]
) -> np.ndarray:
    """A height (metres, within ``_CROWN_HEIGHT_M``) for each crown drawn: taller the wider, loosely."""
    d_min, d_max = diameter_m
    diameters = np.array([2 * crown.radius * pixel_size for crown in drawn], dtype=np.float64)
    span = d_max - d_min
    size = np.clip((diameters - d_min) / span, 0, 1) if span > 0 else np.full(len(drawn), 0.5)
    w = _HEIGHT_FROM_DIAMETER
    share = np.clip(w * size + (1 - w) * rng.random(len(drawn)), 0, 1)
    lo, hi = _CROWN_HEIGHT_M
    return lo + (hi - lo) * share


def _paint_canopy_height(
    drawn: list[_Crown], tree_heights: np.ndarray, width: int, height: int
) -> tuple[np.ndarray, list[_Top]]:
    """The canopy height raster (H, W) float32 and the visible tree tops.

    Each crown is a dome ``h * sqrt(1 - (rho / edge)^2)`` over the pixels whose centres lie inside its outline
    (where :func:`_draw_crown`'s rim is at least half opaque); the crown drawn on top owns a pixel. Crowns are
    painted top to bottom, each only on pixels no crown above it has taken, so a crown's top is visible when its
    apex pixel (its dome's highest pixel) is still free when it is painted.
    """
    canopy = np.zeros((height, width), dtype=np.float32)
    taken = np.zeros((height, width), dtype=bool)
    tops: list[_Top] = []
    for crown, tree_height in zip(drawn[::-1], tree_heights[::-1], strict=True):
        window = _crown_window(crown, width, height)
        if window is None:  # not drawn: owns no pixel
            continue
        r0, r1, c0, c1, dx, dy = window
        rho, edge = _outline(crown, dx, dy)
        inside = rho <= edge
        dome = np.float32(tree_height) * np.sqrt(np.clip(1 - (rho / edge) ** 2, 0, 1))
        free = inside & ~taken[r0:r1, c0:c1]
        canopy[r0:r1, c0:c1][free] = dome[free]
        taken[r0:r1, c0:c1] |= inside
        apex = _apex(crown)
        if r0 <= apex[0] < r1 and c0 <= apex[1] < c1 and free[apex[0] - r0, apex[1] - c0]:
            tops.append(_Top(apex[0], apex[1], float(dome[apex[0] - r0, apex[1] - c0])))
    tops.reverse()  # bottom to top, like ``drawn``
    return canopy, tops


def _apex(crown: _Crown) -> tuple[int, int]:
    """Row and column of the crown's apex: the pixel near its centre where ``rho / edge`` is smallest."""
    r0, _, c0, _, dx, dy = _local_grid(crown.cx, crown.cy, 2.5, 0, 0, clip=False)
    rho, edge = _outline(crown, dx, dy)
    row, col = np.unravel_index(int(np.argmin(rho / edge)), rho.shape)
    return r0 + int(row), c0 + int(col)


# --------------------------------------------------------------------------------------------- output


def _tiled_profile(bands: np.ndarray, crs: str, transform: Affine, block_size: int, predictor: int) -> dict:
    """The profile of a tiled, deflate-compressed GeoTIFF of ``bands`` (count, H, W) with ``predictor``."""
    count, height, width = bands.shape
    return {
        "driver": "GTiff",
        "width": width,
        "height": height,
        "count": count,
        "dtype": bands.dtype.name,
        "crs": crs,
        "transform": transform,
        "tiled": True,
        "blockxsize": block_size,
        "blockysize": block_size,
        "compress": "deflate",
        "predictor": predictor,
    }


def _write_raster(path: Path, canvas: np.ndarray, crs: str, transform: Affine, block_size: int) -> None:
    """Write a (3, H, W) uint8 array as a tiled, deflate-compressed RGB GeoTIFF; a (4, H, W) one as RGB + NIR
    (the 4th band's colour interpretation undefined), with band descriptions."""
    count = canvas.shape[0]
    profile = {**_tiled_profile(canvas, crs, transform, block_size, 2), "interleave": "pixel", "photometric": "RGB"}
    with atomic_path(path) as tmp, rasterio.open(tmp, "w", **profile) as dst:
        dst.write(canvas)
        if count == 4:
            for band, name in enumerate(_BAND_NAMES, start=1):
                dst.set_band_description(band, name)


def _write_height(path: Path, canopy: np.ndarray, crs: str, transform: Affine, block_size: int) -> None:
    """Write the (H, W) float32 canopy height (metres) as a tiled, deflate-compressed GeoTIFF, no nodata."""
    profile = _tiled_profile(canopy[None], crs, transform, block_size, 3)
    with atomic_path(path) as tmp, rasterio.open(tmp, "w", **profile) as dst:
        dst.write(canopy, 1)
        dst.set_band_description(1, "canopy_height_m")


def _write_tops(path: Path, tops: list[_Top], crs: str, transform: Affine) -> None:
    """Write the tree tops as points at their apex pixels' centres, layer ``tree_tops``, with their ``height``."""
    cols = np.array([top.col for top in tops], dtype=np.float64) + 0.5
    rows = np.array([top.row for top in tops], dtype=np.float64) + 0.5
    xs = transform.a * cols + transform.b * rows + transform.c
    ys = transform.d * cols + transform.e * rows + transform.f
    points = gpd.GeoSeries(shapely.points(xs, ys), crs=crs)
    heights = np.array([top.height for top in tops], dtype=np.float64)
    frame = gpd.GeoDataFrame({"height": heights}, geometry=points, crs=crs)
    with atomic_path(path) as tmp:  # the geometry type given, so that a layer without tops is a point layer too
        frame.to_file(tmp, layer=TOPS_LAYER, driver="GPKG", geometry_type="Point")


def _outline_polygon(crown: _Crown) -> shapely.Polygon:
    """The crown's outline (where :func:`_draw_crown`'s rim is half opaque) in pixel coordinates, one vertex
    about every pixel of its perimeter."""
    count = max(64, math.ceil(2 * math.pi * crown.reach))
    theta = np.linspace(0, 2 * math.pi, count, endpoint=False, dtype=np.float64)
    radius = crown.radius * _profile(theta, crown.ks.astype(np.float64), crown.amps, crown.phases)
    return shapely.Polygon(np.stack([crown.cx + radius * np.cos(theta), crown.cy + radius * np.sin(theta)], axis=1))


def _visible_outlines(drawn: list[_Crown], width: int, height: int) -> list[shapely.Geometry]:
    """What shows of each crown drawn (bottom to top), pixel coordinates: its outline inside the raster, less
    the outlines of the crowns drawn above it. Crowns :func:`_draw_crown` skips, and crowns wholly hidden, have
    none."""
    outlines = [_outline_polygon(crown) for crown in drawn]
    tree = shapely.STRtree(outlines)
    frame = shapely.box(0, 0, width, height)
    visible = []
    for index, (crown, outline) in enumerate(zip(drawn, outlines, strict=True)):
        if _crown_window(crown, width, height) is None:
            continue
        shape = shapely.intersection(outline, frame)
        above = [j for j in tree.query(outline, predicate="intersects") if j > index]
        if above:
            shape = shapely.difference(shape, shapely.union_all([outlines[j] for j in above]))
        if not shape.is_empty and shape.area > 0:
            visible.append(shape)
    return visible


def _write_crown_polygons(path: Path, shapes: list[shapely.Geometry], crs: str, transform: Affine) -> None:
    """Write pixel-coordinate polygons georeferenced by ``transform``, layer ``crowns``, labelled ``tree``."""
    a, b, c, d, e, f = transform.a, transform.b, transform.c, transform.d, transform.e, transform.f
    geoms = shapely.transform(np.asarray(shapes, dtype=object), lambda xy: xy @ np.array([[a, d], [b, e]]) + (c, f))
    frame = gpd.GeoDataFrame({"label": [LABEL] * len(geoms)}, geometry=gpd.GeoSeries(geoms, crs=crs), crs=crs)
    with atomic_path(path) as tmp:
        frame.to_file(tmp, layer=LAYER, driver="GPKG", geometry_type="MultiPolygon", promote_to_multi=True)


def _write_boxes(path: Path, pixel_boxes: list[tuple[int, int, int, int]], crs: str, transform: Affine) -> None:
    """Write pixel boxes (c0, r0, c1, r1) as georeferenced box polygons, layer ``crowns``."""
    geoms = pixel_boxes_to_polygons(np.asarray(pixel_boxes, dtype=np.float64).reshape(-1, 4), transform)
    frame = gpd.GeoDataFrame({"label": [LABEL] * len(geoms)}, geometry=gpd.GeoSeries(geoms, crs=crs), crs=crs)
    with atomic_path(path) as tmp:
        frame.to_file(tmp, layer=LAYER, driver="GPKG", geometry_type="Polygon")
