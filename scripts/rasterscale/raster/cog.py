"""Tiled Cloud Optimized GeoTIFFs: of striped rasters, and of the rasters a merge writes block by block.

A windowed read of a striped (untiled) GeoTIFF decodes every strip the window crosses, whole raster rows wide:
a 400 px tile of a 50k px wide raster decodes 125 times the pixels it needs, and dataloader workers reading
neighbouring tiles decode the same strips again. The workflow therefore reads such a scene from a tiled COG
(internal 512 px blocks, deflate, overviews), made once by the rule ``cog`` (:func:`convert_to_cog`,
rio_cogeo's conversion).

A merge writes its layer into an uncompressed scratch raster tiled as the COG is (:func:`scratch_profile`), which
:func:`cog_of_scratch` makes the COG: the overviews built into it, then one compressed copy, on ``threads`` cores.
That is the COG rio_cogeo's conversion of the scratch raster would write (the same file), without its two extra
passes over the pixels (a copy through a warped VRT into its own uncompressed intermediate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import rasterio
from rasterio.enums import MaskFlags, Resampling
from rasterio.shutil import copy as copy_raster

from rasterscale.atomic import atomic_path
from rasterscale.raster.headers import check_raster
from rasterscale.raster.remote import gdal_path, is_remote, open_raster

if TYPE_CHECKING:
    from rio_cogeo.cogeo import RIOResampling

BLOCK_SIZE = 512
# rio_cogeo's "deflate" profile with the horizontal predictor: the COG's layout and codec (convert_to_cog's)
# deflate at level 1: a valid deflate COG of the same pixels, 10-15% larger than level 6 and written 6-10 times
# faster (a merge's probabilities 4.3 -> 0.6 s, values 8.0 -> 0.7 s on a 6144² scene)
ZLEVEL = 1
COG_PROFILE = {
    "driver": "GTiff",
    "interleave": "pixel",
    "tiled": True,
    "compress": "DEFLATE",
    "predictor": 2,
    "zlevel": ZLEVEL,
}


def convert_to_cog(
    src: str | Path,
    dst: str | Path,
    block_size: int = BLOCK_SIZE,
    threads: int = 1,
    overview_resampling: RIOResampling = "nearest",
    add_mask: bool = False,
) -> None:
    """Write ``src`` as a tiled, deflate-compressed COG with overviews (same pixels, bands, nodata, CRS and
    transform), atomically. ``overview_resampling``: how overviews are computed (``mode`` for class ids,
    ``average`` for continuous values); ``add_mask``: keep ``src``'s mask as an internal mask band. A full file
    system on the way is a DiskFullError naming ``dst`` (:func:`conversion_bytes`)."""
    from rio_cogeo.cogeo import cog_translate
    from rio_cogeo.profiles import cog_profiles

    profile = cog_profiles.get("deflate")
    profile.update(blockxsize=block_size, blockysize=block_size, predictor=2, zlevel=ZLEVEL)
    config = {"GDAL_NUM_THREADS": str(threads), "GDAL_TIFF_OVR_BLOCKSIZE": str(block_size)}
    with atomic_path(dst, room=conversion_bytes(src, block_size, add_mask), silent_failures=True) as tmp:
        cog_translate(
            str(src),
            str(tmp),
            profile,
            config=config,
            in_memory=False,
            quiet=True,
            overview_resampling=overview_resampling,
            add_mask=add_mask,
        )


def scratch_profile(profile: Mapping[str, Any], block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """The profile of a scratch raster that :func:`cog_of_scratch` makes a COG of: ``profile``'s size, bands,
    dtype, georeferencing and nodata, tiled in the COG's ``block_size`` px blocks, pixel-interleaved, uncompressed
    (rio_cogeo's intermediate copy's)."""
    kept = ("width", "height", "count", "dtype", "crs", "transform", "nodata")
    return {
        **{key: profile[key] for key in kept if key in profile},
        "driver": "GTiff",
        "interleave": "pixel",
        "tiled": True,
        "blockxsize": block_size,
        "blockysize": block_size,
        "compress": "none",
    }


def cog_of_scratch(
    scratch: str | Path,
    dst: str | Path,
    block_size: int = BLOCK_SIZE,
    overview_resampling: RIOResampling = "nearest",
    threads: int = 1,
) -> None:
    """Make a closed scratch raster (:func:`scratch_profile`, every pixel, its mask, tags and band metadata
    written) the COG at ``dst``, atomically: what :func:`convert_to_cog` writes of it (``add_mask``: when it has
    a mask). Its overviews (``overview_resampling``) are built into the scratch raster, which then holds them; the
    copy compresses on ``threads`` cores. A full file system on the way is a DiskFullError naming ``dst``."""
    from rasterio.rio.overview import get_maximum_overview_level

    config = {
        "GDAL_NUM_THREADS": str(threads),
        "GDAL_TIFF_OVR_BLOCKSIZE": str(block_size),
        "GDAL_TIFF_INTERNAL_MASK": "YES",  # a mask's overviews, and the COG's mask, in the file
    }
    with rasterio.Env(**config), rasterio.open(scratch, "r+") as raster:
        levels = get_maximum_overview_level(raster.width, raster.height, minsize=block_size)
        raster.build_overviews([2**level for level in range(1, levels + 1)], Resampling[overview_resampling])
        raster.update_tags(OVERVIEW_RESAMPLING=Resampling[overview_resampling].name.upper())  # as rio_cogeo tags it
        masked = MaskFlags.per_dataset in raster.mask_flag_enums[0]
    profile = {**COG_PROFILE, "blockxsize": block_size, "blockysize": block_size, "num_threads": str(threads)}
    room = conversion_bytes(scratch, block_size, masked) // 2  # the COG's share: no larger than its pixels
    with rasterio.Env(**config), atomic_path(dst, room=room, silent_failures=True) as tmp:
        copy_raster(str(scratch), str(tmp), copy_src_overviews=True, **profile)


def conversion_bytes(src: str | Path, block_size: int = BLOCK_SIZE, add_mask: bool = False) -> int:
    """At most the bytes a conversion of ``src`` writes: rio_cogeo's intermediate copy (uncompressed: every band, and
    the mask with ``add_mask``, in whole ``block_size`` px blocks, with as many overviews as rio_cogeo builds), then
    the COG (compressed: no larger). rio_cogeo removes the copy, and GDAL the unfinished COG, before a failure
    reaches the caller: a conversion that fails with less space left than this ran out of it
    (:func:`rasterscale.atomic.writing`'s ``room``)."""
    from rasterio.rio.overview import get_maximum_overview_level

    with open_raster(src) as raster:
        width, height = raster.width, raster.height
        pixel = sum(np.dtype(dtype).itemsize for dtype in raster.dtypes) + (1 if add_mask else 0)
    levels = get_maximum_overview_level(width, height, minsize=block_size)  # rio_cogeo's overviews
    blocks = sum(
        _blocks(width, 2**level, block_size) * _blocks(height, 2**level, block_size) for level in range(levels + 1)
    )
    return 2 * blocks * block_size * block_size * pixel


def _blocks(length: int, factor: int, block_size: int) -> int:
    """The blocks along an axis of ``length`` px of an overview of ``factor``."""
    pixels = math.ceil(length / factor)
    return math.ceil(pixels / block_size)


def striped_sources(path: str | Path) -> list[str]:
    """The striped rasters a read of ``path`` decodes: ``path`` itself when striped, or, for a mosaic (a GDAL
    VRT, whose own 128 px blocks say nothing of its sources' layout), its striped source files."""
    info = check_raster(path)
    if not info.is_tiled:
        return [str(path)]
    if info.driver != "VRT":  # from the header: a remote GeoTIFF is not fetched again to list its files
        return []
    with open_raster(path) as src:
        sources = [name for name in src.files if not _same_file(name, path)]
    return [name for name in sources if not check_raster(name).is_tiled]


def _same_file(name: str, path: str | Path) -> bool:
    """Whether GDAL's name of a file (a remote one's is its /vsi... path) is ``path``."""
    if is_remote(path) or is_remote(name):
        return name == gdal_path(path)
    return Path(name).resolve() == Path(path).resolve()
