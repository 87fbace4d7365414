"""Striped rasters to tiled Cloud Optimized GeoTIFFs.

A windowed read of a striped (untiled) GeoTIFF decodes every strip the window crosses, whole raster rows wide:
a 400 px tile of a 50k px wide raster decodes 125 times the pixels it needs, and dataloader workers reading
neighbouring tiles decode the same strips again. The workflow therefore reads such a scene from a tiled COG
(internal 512 px blocks, deflate, overviews), made once by the rule ``convert_to_cog``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rasterscale.atomic import atomic_path
from rasterscale.raster.headers import check_raster
from rasterscale.raster.remote import gdal_path, is_remote, open_raster

if TYPE_CHECKING:
    from rio_cogeo.cogeo import RIOResampling

BLOCK_SIZE = 512


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
    ``average`` for continuous values); ``add_mask``: keep ``src``'s mask as an internal mask band."""
    from rio_cogeo.cogeo import cog_translate
    from rio_cogeo.profiles import cog_profiles

    profile = cog_profiles.get("deflate")
    profile.update(blockxsize=block_size, blockysize=block_size, predictor=2)
    config = {"GDAL_NUM_THREADS": str(threads), "GDAL_TIFF_OVR_BLOCKSIZE": str(block_size)}
    with atomic_path(dst) as tmp:
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
