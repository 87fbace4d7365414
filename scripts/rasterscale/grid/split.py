"""The training scene's split: its bottom band of tiles validates, the rest trains, and a raster too small for a
validation band is refused at plan time."""

from __future__ import annotations

import math

from rasterscale.errors import InputError
from rasterscale.grid.manifest import tile_offsets
from rasterscale.grid.tile import Tile
from rasterscale.raster.headers import RasterInfo


def split_train_validation(tiles: list[Tile], raster_height: int, validation_fraction: float) -> tuple[list, list]:
    """Tiles wholly above the held-out bottom band train; tiles wholly inside it validate; the rest are unused."""
    if validation_fraction <= 0:
        return tiles, []
    boundary = raster_height * (1.0 - validation_fraction)
    train = [t for t in tiles if t.row_off + t.height <= boundary]
    validation = [t for t in tiles if t.row_off >= boundary]
    return train, validation


def check_validation_band(raster: RasterInfo, scene: str, patch_size: int, overlap: int, fraction: float) -> None:
    """A training scene must hold whole tiles both above its held-out bottom band (``train.validation_fraction``
    of its height) and inside it: otherwise training, or validation, would silently get none of its tiles (and
    the tiles across the band's edge are used by neither). Judged on the tile grid of the raster's header."""
    if fraction <= 0:
        return
    height = raster.height
    rows = [
        Tile(k, 0, row, raster.width, min(patch_size, height))
        for k, row in enumerate(tile_offsets(height, patch_size, overlap))
    ]
    train, validation = split_train_validation(rows, height, fraction)
    if train and validation:
        return
    where = f"{raster.path}: training scene {scene} is {height} px high"
    if height < 2 * patch_size:
        raise InputError(
            f"{where}, too small to hold out a validation band of whole {patch_size} px tiles below training tiles; "
            f"set train.validation_fraction: 0 (no validation), or tiling.patch_size to at most {height // 2}"
        )
    if not validation:
        least = math.ceil(100 * patch_size / height) / 100
        raise InputError(
            f"{where}: its validation band (train.validation_fraction {fraction:g}, the bottom "
            f"{round(height * fraction)} px) holds no whole {patch_size} px tile, so validation would never run; set "
            f"train.validation_fraction to at least {least:g}, or 0 to train without validation"
        )
    most = math.floor(100 * (1 - patch_size / height)) / 100
    raise InputError(
        f"{where}: above its validation band (train.validation_fraction {fraction:g}) no whole {patch_size} px tile "
        f"is left to train on; set train.validation_fraction to at most {most:g}"
    )
