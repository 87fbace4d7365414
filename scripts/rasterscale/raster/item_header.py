"""A raster's header from its STAC item: the ``proj`` extension (``proj:code`` or ``proj:epsg`` or ``proj:wkt2``,
``proj:shape``, ``proj:transform`` or ``proj:bbox``) and the bands' metadata (``raster:bands`` of STAC 1.0, or
``bands`` of STAC 1.1: each band's ``data_type`` and ``nodata``, or the asset's own; the band count from them or
from ``eo:bands``). An asset's own fields take precedence over the item's properties, as STAC specifies.

:func:`item_header` reads them from the item's plain JSON (no pystac: a dict lookup or two a field, 30 µs an
item) into an :class:`ItemHeader`, or None when one is missing or malformed (the raster's header is read then, as
for any raster). The plan builds the scene's :class:`rasterscale.raster.headers.RasterInfo` from it
(:meth:`ItemHeader.raster_info`) and opens no raster; the scene's tile-manifest job reads the real header and
compares (:func:`disagreement`), one line naming the item and the field where they differ."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from affine import Affine
from rasterio.crs import CRS
from rasterio.errors import CRSError

from rasterscale.atomic import write_json
from rasterscale.errors import InputError
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.raster.remote import shown

# STAC's data_type values as numpy's (rasterio's) names; "other" and unknown values are not trusted
DATA_TYPES = {
    **{name: name for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
    **{name: name for name in ("float16", "float32", "float64")},
    "cint16": "complex_int16",
    "cint32": "complex64",
    "cfloat32": "complex64",
    "cfloat64": "complex128",
}
TRUSTED_BLOCK = 512  # the block size a trusted raster is taken to have (STAC says nothing of it): tiled, a COG's
# a STAC writer's rounding is no disagreement: a pixel's size and rotation to 1e-7 of it, the origin to 1e-3 pixel
PIXEL_TOLERANCE, ORIGIN_TOLERANCE = 1e-7, 1e-3


@dataclass(frozen=True, slots=True)
class ItemHeader:
    """What a STAC item says of its asset's raster, and the keys it said it with (for the job's one line)."""

    item: str  # the item's id
    source: str  # the Item or ItemCollection it came from
    crs: str  # "EPSG:26916", or a WKT2
    width: int
    height: int
    transform: tuple[float, float, float, float, float, float]
    dtypes: tuple[str, ...]  # one a band
    nodata: float | None
    keys: tuple[str, str, str, str]  # where the CRS, transform, band count and data type came from

    def raster_info(self, path: str) -> RasterInfo:
        """The header the plan trusts: no mask, no alpha, tiled (:data:`TRUSTED_BLOCK`), of no known driver."""
        count = len(self.dtypes)
        return RasterInfo(
            path,
            self.width,
            self.height,
            count,
            _crs(self.crs),
            Affine(*self.transform),
            ((TRUSTED_BLOCK, TRUSTED_BLOCK),) * count,
            self.dtypes,
            None,
            self.nodata,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "item": self.item,
            "source": self.source,
            "crs": self.crs,
            "width": self.width,
            "height": self.height,
            "transform": list(self.transform),
            "dtypes": list(self.dtypes),
            "nodata": _json_number(self.nodata),
            "keys": list(self.keys),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ItemHeader:
        t = data["transform"]
        keys = data["keys"]
        return cls(
            data["item"],
            data["source"],
            data["crs"],
            int(data["width"]),
            int(data["height"]),
            (float(t[0]), float(t[1]), float(t[2]), float(t[3]), float(t[4]), float(t[5])),
            tuple(data["dtypes"]),
            _nodata(data["nodata"]),
            (keys[0], keys[1], keys[2], keys[3]),
        )


@functools.lru_cache(maxsize=256)
def _crs(text: str) -> CRS:
    return CRS.from_user_input(text)


def _parses(crs: str) -> bool:
    """Whether PROJ knows the CRS (once per CRS: the items of a collection share a few)."""
    try:
        _crs(crs)
    except CRSError:
        return False
    return True


def item_header(
    item: Mapping[str, Any], asset: Mapping[str, Any], source: str, data_type: str | None = None
) -> ItemHeader | None:
    """The header an item's asset says its raster has, or None when the item lacks (or garbles) a part of it;
    ``data_type`` (``stac.data_type``): every band's where the item gives none."""
    properties = item.get("properties")
    fields = _Fields(asset, properties if isinstance(properties, Mapping) else {})
    try:
        crs, crs_key = _crs_text(fields)
        shape = fields.get("proj:shape")
        height, width = int(shape[0]), int(shape[1])
        transform, transform_key = _transform(fields, width, height)
        bands, bands_key = _bands(fields)
        given = [_band_field(fields, band, "data_type", data_type is not None) for band in bands]
        dtypes = tuple(DATA_TYPES[str(data_type if value is None else value)] for value in given)
        nodata = _nodata(_band_field(fields, bands[0], "nodata")) if bands else None
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if not crs or width < 1 or height < 1 or not dtypes or not _parses(crs):
        return None
    keys = (crs_key, transform_key, bands_key, f"{bands_key} data_type" if None not in given else "stac.data_type")
    return ItemHeader(str(item.get("id")), source, crs, width, height, transform, dtypes, nodata, keys)


@dataclass(frozen=True)
class _Fields:
    """An asset's fields over its item's properties."""

    asset: Mapping[str, Any]
    properties: Mapping[str, Any]

    def get(self, key: str) -> Any:
        if key in self.asset:
            return self.asset[key]
        return self.properties.get(key)


def _crs_text(fields: _Fields) -> tuple[str, str]:
    code = fields.get("proj:code")
    if isinstance(code, str) and code:
        return code, "proj:code"
    epsg = fields.get("proj:epsg")
    if isinstance(epsg, int) and not isinstance(epsg, bool):
        return f"EPSG:{epsg}", "proj:epsg"
    wkt = fields.get("proj:wkt2")
    if isinstance(wkt, str) and wkt:
        return wkt, "proj:wkt2"
    raise KeyError("proj:code")


def _transform(fields: _Fields, width: int, height: int) -> tuple[tuple[float, float, float, float, float, float], str]:
    terms = fields.get("proj:transform")
    if isinstance(terms, Sequence) and len(terms) in (6, 9):
        a, b, c, d, e, f = (float(term) for term in terms[:6])
        return (a, b, c, d, e, f), "proj:transform"
    bbox = fields.get("proj:bbox")
    if isinstance(bbox, Sequence) and len(bbox) in (4, 6):
        left, bottom = float(bbox[0]), float(bbox[1])
        right, top = (float(bbox[3]), float(bbox[4])) if len(bbox) == 6 else (float(bbox[2]), float(bbox[3]))
        return ((right - left) / width, 0.0, left, 0.0, -(top - bottom) / height, top), "proj:bbox"
    raise KeyError("proj:transform")


def _bands(fields: _Fields) -> tuple[list[Mapping[str, Any]], str]:
    for key in ("bands", "raster:bands", "eo:bands"):
        bands = fields.get(key)
        if isinstance(bands, list) and bands and all(isinstance(band, Mapping) for band in bands):
            return bands, key
    raise KeyError("bands")


def _band_field(fields: _Fields, band: Mapping[str, Any], key: str, defaulted: bool = False) -> Any:
    """A band's field, else the asset's (STAC 1.1 keeps what every band shares there), else the item's; a data
    type found nowhere is a KeyError (None where the config gives a default: ``defaulted``), a nodata found
    nowhere None."""
    if key in band:
        return band[key]
    value = fields.get(key)
    if value is None and key == "data_type" and not defaulted:
        raise KeyError(key)
    return value


def _nodata(value: Any) -> float | None:
    """STAC's nodata (a number, or "nan", "inf", "-inf") as a float."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"nodata {value!r}")
    return float(value)


def _json_number(value: float | None) -> float | str | None:
    if value is not None and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": JSON has no such numbers
    return value


def disagreement(header: ItemHeader, real: RasterInfo) -> str | None:
    """Where a raster's real header differs from what its item said (the first field), as one line naming the
    item, the key and the raster; None when they agree."""
    said = f"STAC item '{header.item}' of {header.source}:"
    raster = f"its raster {shown(real.path)}"
    if (real.width, real.height) != (header.width, header.height):
        return (
            f"{said} proj:shape [{header.height}, {header.width}] but {raster} is {real.width} x {real.height} "
            "(width x height)"
        )
    if not _same_crs(header.crs, real.crs):
        found = real.crs.to_string() if real.crs is not None else "no CRS"
        return f"{said} {header.keys[0]} {_short(header.crs)} but {raster} is in {_short(found)}"
    if not _same_transform(header.transform, tuple(real.transform)[:6]):
        given = _terms(header.transform)
        return f"{said} {header.keys[1]} gives the transform {given} but {raster} has {_terms(tuple(real.transform))}"
    if len(header.dtypes) != real.count:
        return f"{said} {header.keys[2]} lists {len(header.dtypes)} band(s) but {raster} has {real.count}"
    if header.dtypes != tuple(real.dtypes):
        return f"{said} {header.keys[3]} {', '.join(header.dtypes)} but {raster} is {', '.join(real.dtypes)}"
    if not _same_nodata(header.nodata, real.nodata):
        return f"{said} nodata {header.nodata} but {raster} has nodata {real.nodata}"
    return None


def _same_crs(text: str, crs: CRS | None) -> bool:
    if crs is None:
        return False
    try:
        said = _crs(text)
    except CRSError:
        return False
    if said == crs:
        return True
    epsg = said.to_epsg()
    return epsg is not None and epsg == crs.to_epsg()


def _same_transform(said: Sequence[float], real: Sequence[float]) -> bool:
    pixel = max(abs(real[0]), abs(real[1]), abs(real[3]), abs(real[4]))
    return all(
        math.isclose(
            said[k], real[k], rel_tol=0.0, abs_tol=(ORIGIN_TOLERANCE if k in (2, 5) else PIXEL_TOLERANCE) * pixel
        )
        for k in range(6)
    )


def _same_nodata(said: float | None, real: float | None) -> bool:
    if said is None or real is None:
        return said is real
    return said == real or (math.isnan(said) and math.isnan(real))


def _short(crs: str, length: int = 60) -> str:
    return crs if len(crs) <= length else crs[:length] + "..."


def _terms(transform: Sequence[float]) -> str:
    return "[" + ", ".join(f"{term:g}" for term in tuple(transform)[:6]) + "]"


# -- a raster found not to be what its item said: recorded by its tile-manifest job, read by the next plan ---------


def verify(header: ItemHeader, path: str, record: str | Path) -> RasterInfo:
    """The real header of a raster whose item's the plan trusted (:func:`check_raster`), when they agree; else (or
    when the raster will not read) the reason is written to ``record`` (JSON: the scene's raster, what the item
    said, why; read by :func:`recorded_skips`) and raised as one line."""
    try:
        real = check_raster(path)
        reason = disagreement(header, real)
    except InputError as err:
        reason = f"STAC item '{header.item}' of {header.source}: {err}"
    if reason is None:
        return real
    write_json({"raster": path, "item": header.to_dict(), "reason": reason}, record)
    raise InputError(reason)


def recorded_skips(folder: str | Path, trusted: Mapping[str, tuple[str, ItemHeader]]) -> dict[str, str]:
    """The scenes of ``trusted`` (scene -> its raster and item header) whose tile-manifest job recorded in ``folder``
    that their raster is not what their item says (or will not read), with the reason; a record of another raster
    or of what an item said before (the item changed since) does not count. One listing of the folder."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    found = {}
    for name in names:
        scene = name.removesuffix(".json")
        if scene == name or scene not in trusted:
            continue
        try:
            record = json.loads(Path(folder, name).read_text())
        except (OSError, ValueError):
            continue
        path, header = trusted[scene]
        if isinstance(record, dict) and record.get("raster") == path and record.get("item") == header.to_dict():
            found[scene] = str(record.get("reason"))
    return found
