"""Windows of whole pixels, as thin helpers over :mod:`rasterio.windows`: a tile's window, the part two windows
share, the window that bounds several, and where one window lies in another's array."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from rasterio import windows
from rasterio.windows import Window


class PixelRect(Protocol):
    """Anything with a pixel window's offsets and size (a manifest's tile)."""

    @property
    def col_off(self) -> int: ...
    @property
    def row_off(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...


def tile_window(tile: PixelRect) -> Window:
    return Window(tile.col_off, tile.row_off, tile.width, tile.height)


def windows_intersect(a: Window, b: Window) -> bool:
    """Whether two windows share a pixel (touching edges share none)."""
    return bool(windows.intersect(a, b))


def intersection(a: Window, b: Window) -> Window | None:
    """The pixels two windows share, or None when they share none (rasterio's ``intersection`` raises there)."""
    return windows.intersection(a, b) if windows.intersect(a, b) else None


def bounding_window(items: Iterable[Window]) -> Window | None:
    """The smallest window holding every one of ``items`` (rasterio's ``union``), or None for none."""
    items = list(items)
    return windows.union(*items) if items else None


def overlap_slices(inner: Window, outer: Window) -> tuple[slice, slice]:
    """Row and column slices of ``inner`` (contained in ``outer``) in ``outer``'s array."""
    r0, c0 = inner.row_off - outer.row_off, inner.col_off - outer.col_off
    return slice(r0, r0 + inner.height), slice(c0, c0 + inner.width)
