"""A scene of bright discs on dark textured ground, with their boxes and outlines: objects a detector or segmenter
learns in a few dozen steps, so that a test can train one through the workflow and measure what it finds."""

from __future__ import annotations

from pathlib import Path

import geopandas as gpd
import numpy as np
import shapely
from affine import Affine

from conftest import write_raster

UTM17N = "EPSG:32617"
ORIGIN = (404000.0, 3285000.0)  # upper-left corner, m
PIXEL = 0.1  # m


def place_discs(rng: np.random.Generator, side: int, radii: tuple[int, int], cover: float) -> np.ndarray:
    """Centres and radii (x, y, r in px) of discs that do not touch, covering about ``cover`` of the scene."""
    placed: list[tuple[float, float, float]] = []
    area = 0.0
    for _ in range(50 * side * side // (radii[1] ** 2)):
        if area >= cover * side * side:
            break
        x, y = rng.uniform(0, side, 2)
        r = rng.uniform(*radii)
        if placed:
            others = np.asarray(placed)
            if (np.hypot(others[:, 0] - x, others[:, 1] - y) < others[:, 2] + r + 4).any():
                continue
        placed.append((x, y, r))
        area += np.pi * r * r
    return np.asarray(placed)


def disc_scene(folder: Path, name: str, side: int, seed: int, radii: tuple[int, int] = (14, 28)) -> Path:
    """``folder/name.tif`` (RGB uint8, tiled), ``name.gpkg`` (the discs' boxes inside the scene, label "tree") and
    ``name.outlines.gpkg`` (their outlines); returns the raster's path."""
    rng = np.random.default_rng(seed)
    discs = place_discs(rng, side, radii, cover=0.3)
    rows, cols = np.mgrid[0:side, 0:side].astype(np.float32) + 0.5
    inside = np.zeros((side, side), dtype=bool)
    for x, y, r in discs:
        r0, r1, c0, c1 = (int(max(0, v)) for v in (y - r - 1, y + r + 2, x - r - 1, x + r + 2))
        inside[r0:r1, c0:c1] |= np.hypot(cols[r0:r1, c0:c1] - x, rows[r0:r1, c0:c1] - y) <= r
    ground = rng.normal(0, 12, (3, side, side)) + np.array([70, 62, 48])[:, None, None]
    disc = rng.normal(0, 12, (3, side, side)) + np.array([150, 200, 120])[:, None, None]
    data = np.clip(np.where(inside, disc, ground), 0, 255).astype(np.uint8)
    transform = Affine(PIXEL, 0, ORIGIN[0], 0, -PIXEL, ORIGIN[1])
    raster = write_raster(folder / f"{name}.tif", side, side, crs=UTM17N, transform=transform, data=data)
    x, y = ORIGIN[0] + discs[:, 0] * PIXEL, ORIGIN[1] - discs[:, 1] * PIXEL
    outlines = shapely.buffer(shapely.points(x, y), discs[:, 2] * PIXEL, quad_segs=16)
    outlines = shapely.intersection(
        outlines, shapely.box(ORIGIN[0], ORIGIN[1] - side * PIXEL, ORIGIN[0] + side * PIXEL, ORIGIN[1])
    )
    kept = shapely.area(outlines) >= 0.5 * np.pi * (discs[:, 2] * PIXEL) ** 2  # as the synthetic crowns: half inside
    boxes = shapely.box(*shapely.bounds(outlines[kept]).T)
    labels = {"label": ["tree"] * int(kept.sum())}
    gpd.GeoDataFrame(labels, geometry=boxes, crs=UTM17N).to_file(folder / f"{name}.gpkg", layer="crowns")
    gpd.GeoDataFrame(labels, geometry=outlines[kept], crs=UTM17N).to_file(
        folder / f"{name}.outlines.gpkg", layer="crowns"
    )
    return raster
