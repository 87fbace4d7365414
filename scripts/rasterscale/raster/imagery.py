"""How a scene's pixels become the model's tile: its bands, a mask of invalid pixels, and either a linear scale to
uint8 or the raw values (:mod:`rasterscale.raster.bands` says which a model takes).

The :class:`ImageSpec` of a scene is resolved once, by the tiles rule, from the raster's header and the
scene's config (``scenes.X.bands``, ``scenes.X.scale``, whether its model takes raw values); a percentile stretch,
and a raw scene's per-band statistics, are computed then, from a decimated read (GDAL takes overviews where
present), never from the whole raster. The spec is stored in the manifest's parquet metadata (:data:`SPEC_KEY`)
and every reader takes it from there (:func:`read_spec`), so training and prediction see the same pixels:

- the ``bands`` (one-based, one or more), in that order;
- scaled: each band mapped linearly from ``[low, high]`` to ``[0, 255]`` and clipped (uint8 rasters without a
  declared scale are taken as they are); raw: the values as float32;
- invalid pixels (alpha 0, the raster's nodata value in all bands, the per-dataset mask, non-finite floats) set
  to ``fill`` (raw: to the scene's mean of each band, which the model normalizes to about 0).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import rasterio
from rasterio.errors import RasterioIOError
from rasterio.windows import Window

from rasterscale.errors import InputError, RasterReadError, innermost_cause
from rasterscale.raster.bands import BandStatistics
from rasterscale.raster.headers import DEFAULT_BANDS, RasterInfo, check_raster
from rasterscale.raster.remote import failed_request, is_remote, open_raster, shown, watch_requests

SPEC_KEY = b"rasterscale:imagery"
FILL_VALUE = 0  # what masked pixels become, in training and prediction alike
MASKS = ("none", "alpha", "nodata", "dataset")
PERCENTILE_SIDE = 2048  # longest side of the decimated read a percentile stretch or statistics are computed from


@dataclass(frozen=True)
class ImageSpec:
    """How to read a scene's tiles (see the module docstring)."""

    bands: tuple[int, ...] = DEFAULT_BANDS
    mask: str = "none"  # how invalid pixels are known: none, alpha (band `alpha`), nodata (value), dataset
    alpha: int | None = None
    nodata: float | None = None
    low: tuple[float, ...] | None = None  # per band; None: uint8 taken as is
    high: tuple[float, ...] | None = None
    scale: str = "none"  # where low/high came from: none, declared, percentile <low>-<high>
    fill: int = FILL_VALUE
    raw: bool = False  # the values as float32 (a model that normalizes them itself), not scaled to uint8
    statistics: BandStatistics | None = None  # a raw scene's, from a decimated read

    def __post_init__(self) -> None:
        if self.mask not in MASKS:
            raise ValueError(f"unknown mask {self.mask!r} (one of {', '.join(MASKS)})")
        if (self.low is None) != (self.high is None):
            raise ValueError("low and high are given together")
        if self.raw and self.low is not None:
            raise ValueError("a raw spec has no scale")

    @property
    def count(self) -> int:
        return len(self.bands)

    @property
    def indexes(self) -> list[int | None]:
        """Bands to read in one call: the bands, then the alpha band when the mask is alpha."""
        return [*self.bands, self.alpha] if self.mask == "alpha" else list(self.bands)

    @property
    def dtype(self) -> np.dtype:
        """The tiles' data type: float32 raw values, else uint8."""
        return np.dtype(np.float32 if self.raw else np.uint8)

    def to_json(self) -> str:
        data = asdict(self)
        data["statistics"] = self.statistics.to_dict() if self.statistics else None
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ImageSpec:
        data = json.loads(text)
        for key in ("bands", "low", "high"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        if data.get("statistics"):
            data["statistics"] = BandStatistics.from_dict(data["statistics"])
        return cls(**data)

    def describe(self) -> str:
        """One line for the log."""
        text = f"bands {list(self.bands)}, mask {self.mask}"
        if self.mask == "alpha":
            text += f" (band {self.alpha})"
        elif self.mask == "nodata":
            text += f" (value {self.nodata})"
        if self.raw:
            stats = self.statistics
            if stats is not None:
                means = ", ".join(f"{m:.4g}" for m in stats.mean)
                stds = ", ".join(f"{s:.4g}" for s in stats.std)
                text += f", raw values (mean [{means}], std [{stds}])"
            return text + ", masked pixels filled with each band's mean"
        if self.low is not None and self.high is not None:
            ranges = ", ".join(f"[{lo:g}, {hi:g}]" for lo, hi in zip(self.low, self.high, strict=True))
            text += f", scale {self.scale}: {ranges} -> [0, 255]"
        else:
            text += ", uint8 as stored"
        return text + f", masked pixels filled with {self.fill}"


def mask_of(info: RasterInfo) -> tuple[str, int | None, float | None]:
    """How a raster marks invalid pixels: (kind, alpha band, nodata value)."""
    if info.alpha is not None:
        return "alpha", info.alpha, None
    if info.nodata is not None:
        return "nodata", None, info.nodata
    if info.dataset_mask:
        return "dataset", None, None
    return "none", None, None


def resolve_spec(
    path: str | Path,
    bands: Sequence[int] | None = None,
    scale: Mapping[str, Any] | None = None,
    key: str = "scene",
    raw: bool = False,
) -> ImageSpec:
    """A scene's spec from its raster and config; a percentile stretch, or a raw scene's statistics, computed
    here, once. Bad combinations fail with the one line of :func:`rasterscale.raster.imagery.check_imagery`
    (``key``: the scene's config key, e.g. ``scenes.ortho``)."""
    info = check_raster(path)
    check_imagery(info, bands, scale, key, raw)
    kind, alpha, nodata = mask_of(info)
    spec = ImageSpec(tuple(bands or DEFAULT_BANDS), kind, alpha, nodata, raw=raw)
    if raw:
        return replace(spec, statistics=band_statistics(path, spec, key))
    if not scale:
        return spec
    if "percentile" in scale:
        low_q, high_q = (float(q) for q in scale["percentile"])
        low, high = percentile_range(path, spec, low_q, high_q, key)
        return replace(spec, low=low, high=high, scale=f"percentile {low_q:g}-{high_q:g}")
    low, high = (per_band(scale[name], spec.count) for name in ("min", "max"))
    return replace(spec, low=low, high=high, scale="declared")


def per_band(value: float | Sequence[float], count: int) -> tuple[float, ...]:
    return tuple([float(value)] * count if isinstance(value, int | float) else [float(v) for v in value])


def decimated_read(
    path: str | Path, spec: ImageSpec, max_side: int = PERCENTILE_SIDE
) -> tuple[np.ndarray, np.ndarray | None]:
    """The spec's bands and valid mask from a read decimated to at most ``max_side`` pixels a side (overviews
    where the raster has them): the whole raster is never held in memory."""
    with open_raster(path) as src:
        factor = max(1, math.ceil(max(src.width, src.height) / max_side))
        shape = (max(1, math.ceil(src.height / factor)), max(1, math.ceil(src.width / factor)))
        return read_masked(src, spec, out_shape=shape)


def valid_values(path: str | Path, spec: ImageSpec, what: str, max_side: int = PERCENTILE_SIDE) -> Iterator[np.ndarray]:
    """Each band's valid values of a decimated read (float64); one line naming the raster and ``what`` needs them
    when no pixel is valid."""
    pixels, valid = decimated_read(path, spec, max_side)
    if valid is not None and not valid.any():
        raise InputError(f"{path}: no valid pixel to compute {what} from")
    for values in pixels:
        yield (values[valid] if valid is not None else values.ravel()).astype(np.float64)


def percentile_range(
    path: str | Path, spec: ImageSpec, low_q: float, high_q: float, key: str, max_side: int = PERCENTILE_SIDE
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-band percentiles of the valid pixels of a decimated read (:func:`decimated_read`)."""
    lows, highs = [], []
    for chosen in valid_values(path, spec, f"{key}.scale.percentile", max_side):
        lo, hi = np.percentile(chosen, [low_q, high_q])
        if hi <= lo:  # a constant band: any span maps it to one value
            hi = lo + 1.0
        lows.append(float(lo))
        highs.append(float(hi))
    return tuple(lows), tuple(highs)


def band_statistics(path: str | Path, spec: ImageSpec, key: str, max_side: int = PERCENTILE_SIDE) -> BandStatistics:
    """Per-band mean and std of the valid pixels of a decimated read (:func:`decimated_read`): a raw scene's, which
    ``normalize: auto`` pools over the training scenes."""
    means, stds, count = [], [], 0
    for chosen in valid_values(path, spec, f"the statistics of {key}.bands (normalize)", max_side):
        means.append(float(chosen.mean()))
        stds.append(float(chosen.std()))
        count = int(chosen.size)
    return BandStatistics(tuple(means), tuple(stds), count)


def describe_window(window: Window | None) -> str:
    if window is None:
        return "a decimated read of the whole raster"
    return f"window col {int(window.col_off)}, row {int(window.row_off)}, {int(window.width)} x {int(window.height)} px"


def unreadable(path: str, window: Window | None, err: BaseException, tile_id: int | None = None) -> RasterReadError:
    """The one line of pixels that will not decode: the raster, the tile or window, GDAL's reason. Of a remote
    raster (named by its URL, redacted) the likelier cause is the network: the line says so."""
    where = describe_window(window) if tile_id is None else f"tile {tile_id} ({describe_window(window)})"
    if is_remote(path):
        failed = failed_request()
        cause = innermost_cause(err) + (f"; {failed}" if failed else "")
        return RasterReadError(
            f"{shown(path)}: {where} could not be read ({cause}): the server stopped answering, refused or "
            "throttled the request, or broke the connection (or the file is damaged); check the URL, the network "
            "and credentials, then run the same command again (finished tiles are kept)"
        )
    return RasterReadError(
        f"{path}: {where} will not decode ({innermost_cause(err)}); the file is damaged: copy or export it again"
    )


@contextmanager
def decoding(path: str, window: Window | None = None) -> Iterator[None]:
    """Reads of the raster at ``path`` (of ``window``; None: decimated) inside: pixels that will not decode raise
    :func:`unreadable`'s one line instead of GDAL's error (of a remote raster, with the request that failed)."""
    if is_remote(path):
        watch_requests()
    try:
        yield
    except RasterioIOError as err:
        raise unreadable(path, window, err) from err


def read_masked(
    src: rasterio.io.DatasetReader,
    spec: ImageSpec,
    window: Window | None = None,
    out_shape: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The spec's bands as stored, shape (bands, h, w), and the valid-pixel mask (None: all valid). One read for
    bands and alpha; ``out_shape`` reads decimated."""
    shape = None if out_shape is None else (len(spec.indexes), *out_shape)
    with decoding(src.name, window):
        raw = src.read(indexes=spec.indexes, window=window, out_shape=shape)
        dataset_valid = src.dataset_mask(window=window, out_shape=out_shape) > 0 if spec.mask == "dataset" else None
    pixels, valid = raw[: spec.count], dataset_valid
    if spec.mask == "alpha":
        valid = raw[spec.count] > 0
    elif spec.mask == "nodata":
        nodata = spec.nodata
        invalid = np.isnan(pixels) if nodata is not None and math.isnan(nodata) else pixels == nodata
        valid = ~invalid.all(axis=0)
    if pixels.dtype.kind == "f":
        finite = np.isfinite(pixels).all(axis=0)
        valid = finite if valid is None else valid & finite
    return pixels, valid


def valid_mask(
    src: rasterio.io.DatasetReader, spec: ImageSpec, out_shape: tuple[int, int] | None = None
) -> np.ndarray | None:
    """Valid pixels of the whole raster at ``out_shape`` (None: the raster marks none invalid); reads only
    the mask where it is a band or GDAL's mask, the bands only for a nodata value."""
    if spec.mask == "none":
        return None
    with decoding(src.name):
        if spec.mask == "alpha":
            return src.read(spec.alpha, out_shape=out_shape) > 0
        if spec.mask == "dataset":
            return src.dataset_mask(out_shape=out_shape) > 0
    return read_masked(src, spec, out_shape=out_shape)[1]


def valid_at(path: str | Path, spec: ImageSpec, cols: np.ndarray, rows: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """Whether the pixels at (``cols``, ``rows``) are valid under the spec's mask (pixels outside the raster
    are not). Exact: the mask is read in ``chunk``-pixel squares, only where there are points."""
    cols, rows = np.floor(cols).astype(np.int64), np.floor(rows).astype(np.int64)
    with open_raster(path) as src:
        inside = (cols >= 0) & (rows >= 0) & (cols < src.width) & (rows < src.height)
        if spec.mask == "none":
            return inside
        valid = np.zeros(len(cols), dtype=bool)
        keys = (rows // chunk) * (src.width // chunk + 1) + cols // chunk
        for key in np.unique(keys[inside]):
            members = np.flatnonzero(inside & (keys == key))
            row0, col0 = int(rows[members[0]]) // chunk * chunk, int(cols[members[0]]) // chunk * chunk
            window = Window(col0, row0, min(chunk, src.width - col0), min(chunk, src.height - row0))
            mask = read_masked(src, spec, window=window)[1]
            valid[members] = True if mask is None else mask[rows[members] - row0, cols[members] - col0]
    return valid


def on_data(path: str | Path, spec: ImageSpec, boxes: np.ndarray) -> np.ndarray:
    """Whether each (N, 4) pixel box (xmin, ymin, xmax, ymax) is centred on a valid pixel: no data, no object."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if spec.mask == "none" or not len(boxes):
        return np.ones(len(boxes), dtype=bool)
    return valid_at(path, spec, (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2)


def to_uint8(pixels: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """Bands as stored -> uint8 by the spec's linear scale (clipped); uint8 without a scale as it is."""
    if spec.raw:
        raise ValueError("a raw spec's tiles are float32 values, not uint8 (read them with read_tile)")
    if spec.low is None or spec.high is None:
        if pixels.dtype != np.uint8:
            raise ValueError(f"{pixels.dtype} pixels need a scale to uint8 (scenes.X.scale)")
        return pixels
    low = np.asarray(spec.low, dtype=np.float32)[:, None, None]
    gain = 255.0 / (np.asarray(spec.high, dtype=np.float32)[:, None, None] - low)
    scaled = (pixels.astype(np.float32) - low) * gain
    np.clip(scaled, 0.0, 255.0, out=scaled)
    return np.rint(scaled, out=scaled).astype(np.uint8)


def read_tile(
    src: rasterio.io.DatasetReader, spec: ImageSpec, window: Window, tile_id: int | None = None
) -> np.ndarray:
    """A window as the model's (bands, h, w) tile: uint8 scaled, or float32 raw values; masked pixels filled.
    Pixels that will not decode raise :class:`~rasterscale.errors.RasterReadError` naming the raster and the tile
    (``tile_id``)."""
    try:
        pixels, valid = read_masked(src, spec, window=window)
    except RasterReadError as err:
        raise unreadable(src.name, window, err.__cause__ or err, tile_id) from err.__cause__
    if not spec.raw:
        tile = to_uint8(pixels, spec)
        if valid is not None and not valid.all():
            tile[:, ~valid] = spec.fill
        return tile
    values = pixels.astype(np.float32)
    if valid is not None and not valid.all():
        fill = spec.statistics.mean if spec.statistics else (float(spec.fill),) * spec.count
        values[:, ~valid] = np.asarray(fill, dtype=np.float32)[:, None]
    return values


def manifest_entry(manifest_path: str | Path, key: bytes, what: str, fix: str) -> bytes:
    """An entry the tiles rule stored in a manifest's parquet metadata; one line naming the file, ``what``
    is missing and the ``fix`` otherwise."""
    metadata = pq.read_schema(manifest_path).metadata or {}
    if key not in metadata:
        raise InputError(f"{manifest_path}: tile manifest holds no {what} ({key.decode()}); {fix}")
    return metadata[key]


def read_spec(manifest_path: str | Path) -> ImageSpec:
    """The imagery spec stored with a tile manifest (by the tiles rule)."""
    return ImageSpec.from_json(manifest_entry(manifest_path, SPEC_KEY, "imagery spec", "rerun rule tiles"))


class ProcessRaster:
    """A lazily opened, per-process rasterio handle (safe across fork and pickling)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._src: rasterio.io.DatasetReader | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_src": None, "_pid": None}

    @property
    def src(self) -> rasterio.io.DatasetReader:
        if self._src is None or self._pid != os.getpid():
            self._src = open_raster(self.path)
            self._pid = os.getpid()
            self.opened(self._src)
        return self._src

    def opened(self, src: rasterio.io.DatasetReader) -> None:
        """Called once per process, when the raster has just been opened in it (nothing here)."""


def check_imagery(
    raster: RasterInfo, bands: Sequence[int] | None, scale: Mapping[str, Any] | None, key: str, raw: bool = False
) -> None:
    """Check that a scene's ``bands`` and ``scale`` (config ``<key>.bands``/``<key>.scale``, e.g. key
    ``scenes.ortho``) can make the model's tiles of the raster (``raw``: its values, for a model that normalizes
    them; else scaled to uint8): one line naming the file and the key otherwise."""
    path = raster.path
    given = bands
    bands = list(bands or DEFAULT_BANDS)
    if not bands:
        raise InputError(f"{path}: {key}.bands lists no band; give the (1-based) bands the model sees")
    outside = [b for b in bands if not 1 <= b <= raster.count]
    if outside:
        raise InputError(
            f"{path}: raster has {raster.count} band(s); {key}.bands {bands} asks for band(s) "
            f"{', '.join(map(str, outside))} (bands are 1..{raster.count})"
        )
    if raster.alpha is not None and raster.alpha in bands:
        raise InputError(
            f"{path}: band {raster.alpha} is the alpha band (the mask); leave it out of {key}.bands (a band of data "
            f"marked alpha, e.g. near infrared written as GDAL's default RGBA: gdal_edit.py -colorinterp_"
            f"{raster.alpha} undefined)"
        )
    if raw and scale:
        raise InputError(
            f"{path}: {key}.scale maps bands to 0-255 but the model normalizes raw values (normalize); drop one"
        )
    if not raw:
        check_scale(raster, bands, scale, key)
    colours = raster.count - (raster.alpha is not None)
    if given is None and not scale and colours > len(DEFAULT_BANDS):  # uint8 RGBN, or RGBA not marked so
        raise InputError(
            f"{path}: raster has {colours} bands{' besides its alpha band' if raster.alpha else ''}; set "
            f"{key}.bands to the (1-based) bands the model sees, e.g. [1, 2, 3] for red, green, blue or "
            f"{list(range(1, colours + 1))} for all"
        )


def check_scale(raster: RasterInfo, bands: list[int], scale: Mapping[str, Any] | None, key: str) -> None:
    """Bands that are not uint8 need ``<key>.scale``, and a scale must be well formed."""
    path = raster.path
    dtypes = sorted({raster.dtypes[b - 1] for b in bands}) if raster.dtypes else ["uint8"]
    if not scale:
        if dtypes != ["uint8"]:
            raise InputError(
                f"{path}: bands are {'/'.join(dtypes)}, not uint8; set {key}.scale ({{min: [..], max: [..]}} per "
                "band, or {percentile: [2, 98]}) to map them to 0-255, or normalize them (model.normalize)"
            )
        return
    if "percentile" in scale:
        low, high = scale["percentile"]
        if not 0 <= low < high <= 100:
            raise InputError(f"{path}: {key}.scale.percentile [{low}, {high}] must be 0 <= low < high <= 100")
        return
    limits = {}
    for name in ("min", "max"):
        value = scale.get(name)
        if value is None:
            raise InputError(f"{path}: {key}.scale needs both min and max (or percentile)")
        values = [value] * len(bands) if isinstance(value, int | float) else list(value)
        if len(values) != len(bands):
            raise InputError(
                f"{path}: {key}.scale.{name} has {len(values)} value(s) for the {len(bands)} bands of {key}.bands"
            )
        limits[name] = values
    wrong = [k for k, (lo, hi) in enumerate(zip(limits["min"], limits["max"], strict=True)) if not lo < hi]
    if wrong:
        raise InputError(f"{path}: {key}.scale.min must be below {key}.scale.max (band {bands[wrong[0]]})")


def picture_inches(height: int, width: int, min_side: int = 800, dpi: int = 100) -> tuple[float, float]:
    """A picture's figure size (width, height in inches at ``dpi``) for an image of ``height`` x ``width`` pixels:
    its own size, enlarged to ``min_side`` pixels on its long side (a small scene's title and outlines would not
    fit or show otherwise)."""
    grow = max(1.0, min_side / max(height, width, 1))
    return width * grow / dpi, height * grow / dpi


def display_uint8(image: np.ndarray) -> np.ndarray:
    """uint8 as it is; other types (16-bit, float) stretched per band between their 2nd and 98th percentiles,
    for the picture only."""
    if image.dtype == np.uint8:
        return image
    values = image.astype(np.float32)
    low, high = np.nanpercentile(values, [2, 98], axis=(1, 2), keepdims=True)
    return np.nan_to_num(np.clip((values - low) / np.maximum(high - low, 1e-6) * 255, 0, 255)).astype(np.uint8)
