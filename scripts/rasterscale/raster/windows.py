"""Window arithmetic on rasterio windows of whole pixels: a tile's window, intersections, bounds, and where one
window lies in another's array."""

from __future__ import annotations

from collections.abc import Iterable

from rasterio.windows import Window

from rasterscale.grid.tile import Tile


def tile_window(tile: Tile) -> Window:
    return Window(tile.col_off, tile.row_off, tile.width, tile.height)


def windows_intersect(a: Window, b: Window) -> bool:
    return (
        a.col_off < b.col_off + b.width
        and b.col_off < a.col_off + a.width
        and a.row_off < b.row_off + b.height
        and b.row_off < a.row_off + a.height
    )


def bounding_window(windows: Iterable[Window]) -> Window | None:
    windows = list(windows)
    if not windows:
        return None
    c0 = min(w.col_off for w in windows)
    r0 = min(w.row_off for w in windows)
    c1 = max(w.col_off + w.width for w in windows)
    r1 = max(w.row_off + w.height for w in windows)
    return Window(c0, r0, c1 - c0, r1 - r0)


def overlap_slices(inner: Window, outer: Window) -> tuple[slice, slice]:
    """Row and column slices of ``inner`` (contained in ``outer``) in ``outer``'s array."""
    r0, c0 = inner.row_off - outer.row_off, inner.col_off - outer.col_off
    return slice(r0, r0 + inner.height), slice(c0, c0 + inner.width)


def intersection(a: Window, b: Window) -> Window:
    """The common part of two windows (zero width or height when they do not intersect)."""
    c0, r0 = max(a.col_off, b.col_off), max(a.row_off, b.row_off)
    c1 = min(a.col_off + a.width, b.col_off + b.width)
    r1 = min(a.row_off + a.height, b.row_off + b.height)
    return Window(c0, r0, max(0, c1 - c0), max(0, r1 - r0))
