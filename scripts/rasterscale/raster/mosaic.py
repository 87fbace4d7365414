"""A GDAL VRT mosaic of rasters on one CRS and pixel size (what ``gdalbuildvrt`` writes, without GDAL's command
line tools): one source per raster and band, placed by its geotransform; later sources are drawn over earlier
ones, except where they have no data (their nodata value, or their mask: alpha 0, an internal mask), where the
earlier ones show. A seam between two scenes is read from such a mosaic, so that its tiles see across the scenes'
border (two flights that overlap: the later one's no-data margin leaves the first one's pixels showing).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from affine import Affine
from rasterio.enums import ColorInterp, MaskFlags

from rasterscale.atomic import atomic_path
from rasterscale.errors import InputError
from rasterscale.raster.remote import gdal_path, is_remote, open_raster

GDAL_TYPES = {
    "uint8": "Byte",
    "int8": "Int8",
    "uint16": "UInt16",
    "int16": "Int16",
    "uint32": "UInt32",
    "int32": "Int32",
    "float32": "Float32",
    "float64": "Float64",
}


@dataclass(frozen=True)
class Source:
    """What a mosaic needs of one raster's header."""

    path: str
    transform: Affine
    width: int
    height: int
    count: int
    crs_wkt: str
    dtype: str
    nodata: float | None
    colorinterp: tuple[str, ...]
    masked: bool = False  # its valid pixels are given by a mask band (alpha, internal mask), not a nodata value


def read_source(path: str) -> Source:
    with open_raster(path) as src:
        return Source(
            path,
            src.transform,
            src.width,
            src.height,
            src.count,
            src.crs.to_wkt() if src.crs else "",
            src.dtypes[0],
            src.nodata,
            tuple(ColorInterp(c).name for c in src.colorinterp),
            MaskFlags.per_dataset in src.mask_flag_enums[0],
        )


def _filename(source: str, vrt: Path) -> str:
    """A source's <SourceFilename>: relative to the VRT for a local file (the folder can move), as given for a
    GDAL virtual path or URL."""
    if is_remote(source):
        return f'<SourceFilename relativeToVRT="0">{escape(gdal_path(source))}</SourceFilename>'
    relative = os.path.relpath(Path(source).resolve(), vrt.resolve().parent)
    return f'<SourceFilename relativeToVRT="1">{escape(relative)}</SourceFilename>'


def mosaic_xml(sources: Sequence[Source], vrt: Path) -> str:
    """The VRT document of a mosaic of ``sources`` (same CRS, pixel size, band count and data type as the first;
    one line naming the first one that differs)."""
    first = sources[0]
    px, py = first.transform.a, first.transform.e
    for source in sources[1:]:
        if source.crs_wkt != first.crs_wkt:
            raise InputError(f"{source.path}: CRS differs from {first.path}'s; a mosaic needs one CRS")
        if abs(source.transform.a - px) > 1e-9 * abs(px) or abs(source.transform.e - py) > 1e-9 * abs(py):
            raise InputError(f"{source.path}: pixel size differs from {first.path}'s; a mosaic needs one")
        if (source.count, source.dtype) != (first.count, first.dtype):
            raise InputError(f"{source.path}: bands or data type differ from {first.path}'s")
    left = min(s.transform.c for s in sources)
    top = max(s.transform.f for s in sources)
    right = max(s.transform.c + s.width * px for s in sources)
    bottom = min(s.transform.f + s.height * py for s in sources)
    width, height = round((right - left) / px), round((bottom - top) / py)
    gdal_type = GDAL_TYPES[first.dtype]
    bands = []
    for band in range(1, first.count + 1):
        nodata = f"<NoDataValue>{first.nodata!r}</NoDataValue>" if first.nodata is not None else ""
        interp = first.colorinterp[band - 1] if band <= len(first.colorinterp) else "undefined"
        parts = []
        for s in sources:
            x, y = round((s.transform.c - left) / px), round((s.transform.f - top) / py)
            kind, transparent = _transparency(s)
            parts.append(
                f"<{kind}>{_filename(s.path, vrt)}<SourceBand>{band}</SourceBand>"
                f'<SrcRect xOff="0" yOff="0" xSize="{s.width}" ySize="{s.height}"/>'
                f'<DstRect xOff="{x}" yOff="{y}" xSize="{s.width}" ySize="{s.height}"/>{transparent}</{kind}>'
            )
        bands.append(
            f'<VRTRasterBand dataType="{gdal_type}" band="{band}">{nodata}'
            f"<ColorInterp>{interp.capitalize()}</ColorInterp>{''.join(parts)}</VRTRasterBand>"
        )
    return (
        f'<VRTDataset rasterXSize="{width}" rasterYSize="{height}"><SRS>{escape(first.crs_wkt)}</SRS>'
        f"<GeoTransform>{left!r}, {px!r}, 0, {top!r}, 0, {py!r}</GeoTransform>{''.join(bands)}</VRTDataset>\n"
    )


def _transparency(source: Source) -> tuple[str, str]:
    """A source's element and what leaves its no-data pixels out (as gdalbuildvrt writes them): its nodata value,
    else its mask band (GDAL >= 3.3); a source without either is drawn whole."""
    if source.nodata is not None:
        return "ComplexSource", f"<NODATA>{source.nodata!r}</NODATA>"
    if source.masked:
        return "ComplexSource", "<UseMaskBand>true</UseMaskBand>"
    return "SimpleSource", ""


def write_mosaic(path: str | Path, rasters: Sequence[str]) -> Path:
    """Write the VRT mosaic of ``rasters`` at ``path``, atomically."""
    path = Path(path)
    xml = mosaic_xml([read_source(str(r)) for r in rasters], path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(xml)
    return path
