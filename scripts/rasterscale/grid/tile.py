"""A tile (a window of a raster, by its id in the manifest) and the grid that cuts a raster into tiles: plain
integers, no dependency."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileGrid:
    """How a raster is cut: tiles of ``patch_size`` px whose neighbours overlap by ``overlap`` px."""

    patch_size: int
    overlap: int


@dataclass(frozen=True)
class Tile:
    tile_id: int
    col_off: int
    row_off: int
    width: int
    height: int
