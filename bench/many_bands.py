"""Models of any number of bands: what more bands cost in prediction, and what a GeoTIFF's interleave costs a reader
of many bands. Both measured in the same run, each figure a ratio against a baseline measured alongside it.

- throughput: the same untrained segmenter (U-Net on a ResNet-18, seeded, eval, fp32, prepared as prediction
  prepares it: batch norms folded, channels_last) predicting the same tiles of a synthetic raster of 3 and 4 uint8
  bands (scaled) and of 13 uint16 bands (raw values, normalized by the scene's statistics, as Sentinel-2's
  ``normalize: auto``), each read through the real reader (:class:`RasterHandle`, ``read_tile`` and the scene's
  :class:`ImageSpec`) and scaled and predicted as a prediction rank does (``to_model_input`` of the batch, the
  task's ``forward`` and ``postprocess``). Tiles/s of read + prediction per band count (read in line, as a rank
  without reading workers: with workers the read overlaps the forward), their ratio to 3 bands, and where the time
  goes: the read (a freshly opened raster, the rank's block cache), the input (uint8 to float, normalization,
  padding, the channels_last copy), the first convolution (timed inside the real forward, by hooks) and the rest of the
  network, which more bands leave alone (its FLOPs are the same: torch's FLOP counter puts the whole difference
  in the first convolution). The ratio depends on how fast the rest runs: on 2 idle cores (0.11 s a tile of
  rest) 13 raw bands add 0.035 s a tile, 0.74x; with the cores busy with other work the rest takes 0.37 s and the
  same extra makes 0.86-0.90x.
- interleave: the same 13-band uint16 raster written twice, 256 px blocks, deflate, once pixel-interleaved (a
  block holds every band) and once band-interleaved (a block per band), and every tile of its manifest read
  through ``read_tile`` under the prediction rank's block cache (``predict.read_cache_mb``): all 13 bands and 4 of
  them (Sentinel-2's B04, B03, B02, B08). Band interleave lets the reader of 4 bands skip the others' blocks;
  pixel interleave decodes every band to get any. The files were just written: they are in the page cache, so
  this is decoding, not the disk. The rank's 16 MB cache is sized for RGB: a 400 px tile of 13 uint16 bands
  spans 9 blocks of 1.7 MB, so neighbouring tiles decode their shared blocks again (all 13 bands, either
  interleave: 0.67 s a 2k^2 raster at 16 MB, 0.36 s at 64 MB).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
import torch
from rasterio.env import get_gdal_config, set_gdal_config
from rasterio.windows import Window
from torch.utils.flop_counter import FlopCounterMode

from measures import spread
from rasterscale.config.schema import validate_config
from rasterscale.datasets.tiles import READ_CACHE, RasterHandle, limit_read_cache, to_model_input
from rasterscale.grid.manifest import manifest_frame, tile_grid, tiles_from_frame
from rasterscale.grid.tile import Tile
from rasterscale.raster.bands import RGB_NAMES, InputBands, scaled_input
from rasterscale.raster.imagery import ImageSpec, resolve_spec
from rasterscale.settings import settings_of
from rasterscale.tasks.segmentation.model import build_segmenter
from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig
from rasterscale.tasks.segmentation.task import SegmentationTask
from synthetic import CRS, TRANSFORM

PATCH, OVERLAP = 400, 80
BLOCK = 256
LABELS = ("background", "tree")
# Sentinel-2's 13 bands in the order of an L1C stack; the 4 a model of red, green, blue and near infrared reads
SENTINEL2 = ("B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12")
FOUR_OF_13 = (4, 3, 2, 8)
BAND_COUNTS = (3, 4, 13)  # 3 is the baseline of every ratio
INTERLEAVES = ("pixel", "band")  # pixel is the baseline


def band_pattern(count: int, dtype: str, block: int = BLOCK, seed: int = 0) -> np.ndarray:
    """A (count, block, block) block of smooth gradients plus fine noise, each band at its own level: 0-255 for
    uint8, reflectance-like 0-10000 for uint16."""
    rng = np.random.default_rng(seed)
    top = 255.0 if dtype == "uint8" else 10_000.0
    ramp = np.linspace(0.15, 0.8, block, dtype=np.float32)
    base = (ramp[None, :, None] + ramp[None, None, :]) / 2
    level = 0.6 + 0.4 * np.sin(np.arange(count, dtype=np.float32))[:, None, None]
    pixels = top * (base * level + rng.normal(0, 0.03, (count, block, block)).astype(np.float32))
    return np.clip(pixels, 0, top).astype(dtype)


def write_bands_raster(
    path: Path, side: int, count: int, dtype: str, interleave: str = "pixel", block: int = BLOCK
) -> Path:
    """A side x side tiled GeoTIFF of ``count`` bands (no alpha, no nodata), deflate, written block by block."""
    pattern = band_pattern(count, dtype, block)
    profile = {
        "driver": "GTiff",
        "width": side,
        "height": side,
        "count": count,
        "dtype": dtype,
        "crs": CRS,
        "transform": TRANSFORM,
        "tiled": True,
        "blockxsize": block,
        "blockysize": block,
        "compress": "deflate",
        "interleave": interleave,
        "photometric": "minisblack",  # 3 or 4 uint8 bands: plain bands, not RGB(A)
        "num_threads": "all_cpus",
    }
    n = math.ceil(side / block)
    with rasterio.open(path, "w", **profile) as dst:
        for r in range(n):
            for c in range(n):
                window = Window(c * block, r * block, min(block, side - c * block), min(block, side - r * block))
                shifted = np.roll(pattern, (r * 31 + c * 17) % block, axis=2)
                dst.write(shifted[:, : window.height, : window.width], window=window)
    return path


def grid_tiles(side: int) -> list[Tile]:
    """Every tile of a side x side raster's manifest (``PATCH`` px, ``OVERLAP`` px overlap)."""
    return tiles_from_frame(manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS))


def side_for(tiles: int) -> int:
    """The side of the smallest square raster of at least ``tiles`` tiles."""
    per_side = math.ceil(math.sqrt(tiles))
    return PATCH + (per_side - 1) * (PATCH - OVERLAP)


def scene_of(directory: Path, count: int, side: int) -> tuple[Path, ImageSpec, InputBands]:
    """A synthetic scene of ``count`` bands, its spec (as the tiles step resolves it) and its model's input: 3 and
    4 bands uint8 scaled, 13 bands uint16 raw with the scene's own statistics (``normalize: auto``)."""
    raw = count > 4
    path = write_bands_raster(directory / f"bands-{count}.tif", side, count, "uint16" if raw else "uint8")
    spec = resolve_spec(path, list(range(1, count + 1)), key=f"scenes.bands{count}", raw=raw)
    if not raw:
        return path, spec, scaled_input((*RGB_NAMES, "nir")[:count])
    assert spec.statistics is not None
    pending = InputBands(SENTINEL2[:count], (), (), raw=True)  # normalize: auto, then computed
    bands = pending.with_statistics(spec.statistics.mean, spec.statistics.std)
    return path, spec, bands


def fast_segmenter(bands: InputBands) -> torch.nn.Module:
    """The untrained segmenter of these bands (seeded), prepared as prediction prepares it (channels_last)."""
    torch.manual_seed(0)
    model = build_segmenter(SegmenterConfig(LABELS, patch_size=PATCH, input=bands))
    predict = settings_of(validate_config({"task": "segmentation", "predict": {"channels_last": True}})).predict
    return SegmentationTask().prepare_for_inference(model, predict)


def first_conv(model: torch.nn.Module) -> torch.nn.Conv2d:
    """The network's first convolution: the one layer whose size depends on the bands."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))


class ConvClock:
    """When the first convolution starts and ends within a forward pass (forward hooks; a CPU runs in order)."""

    def __init__(self, conv: torch.nn.Module) -> None:
        self.start = self.end = 0.0
        conv.register_forward_pre_hook(self.started)
        conv.register_forward_hook(self.ended)

    def started(self, module: torch.nn.Module, args: Any) -> None:
        self.start = time.perf_counter()

    def ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.end = time.perf_counter()


def read_seconds(path: Path, spec: ImageSpec, tiles: Sequence[Tile]) -> tuple[list[torch.Tensor], float]:
    """The tiles as a prediction rank's reader gives them (uint8 or raw float32), from a freshly opened raster (its
    block cache empty), and the seconds it took."""
    handle = RasterHandle(path, spec)
    started = time.perf_counter()
    images = [torch.from_numpy(np.ascontiguousarray(handle.read_pixels(tile))) for tile in tiles]
    seconds = time.perf_counter() - started
    handle.src.close()
    return images, seconds


@contextlib.contextmanager
def rank_read_cache() -> Iterator[None]:
    """GDAL's block cache bounded as a prediction rank bounds it (``predict.read_cache_mb``'s default, grown for
    the bytes a pixel of each raster a handle opens caches: :class:`~rasterscale.datasets.tiles.ReadCache`), and as
    it was again after."""
    megabytes, configured = READ_CACHE.megabytes, get_gdal_config("GDAL_CACHEMAX")
    limit_read_cache(read_cache_mb())
    try:
        yield
    finally:
        READ_CACHE.megabytes = megabytes
        set_gdal_config("GDAL_CACHEMAX", configured)


def read_cache_mb() -> int:
    return int(validate_config({})["predict"]["read_cache_mb"])


def predict_seconds(
    model: torch.nn.Module, clock: ConvClock, images: list[torch.Tensor], batch_size: int
) -> dict[str, float]:
    """Seconds of the prediction step over ``images`` (as ``PredictionModule.predict_step``: to model input, the
    task's ``forward`` and ``postprocess``), split into the input (to the first convolution), the first
    convolution, the rest."""
    task = SegmentationTask()
    parts = {"input_s": 0.0, "first_conv_s": 0.0, "rest_s": 0.0}
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            began = time.perf_counter()
            batch = to_model_input(torch.stack(images[start : start + batch_size]))
            task.postprocess(task.forward(model, batch))
            ended = time.perf_counter()
            parts["input_s"] += clock.start - began
            parts["first_conv_s"] += clock.end - clock.start
            parts["rest_s"] += ended - clock.end
    return parts


def gflop(model: torch.nn.Module, count: int) -> tuple[float, float]:
    """The forward's GFLOP for one tile, and its first convolution's (torch's FLOP counter)."""
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.rand(1, count, PATCH, PATCH))
    per_module = counter.get_flop_counts()
    conv_name = next(name for name, m in model.named_modules() if m is first_conv(model))
    conv = sum(per_module.get(f"{type(model).__name__}.{conv_name}", {}).values())
    return counter.get_total_flops() / 1e9, conv / 1e9


def measure_band_throughput(workdir: Path, tiles: int, batch_size: int, rounds: int = 5) -> dict[str, Any]:
    """Tiles/s of the same segmenter reading and predicting the same ``tiles`` at 3, 4 and 13 bands, after one
    untimed warm-up batch each. The band counts take turns, ``rounds`` times; each part's (read, input, first
    convolution, rest) figure is its fastest round: what the work costs, less what other processes took of a shared
    machine's cores (short, alternating rounds keep a burst of theirs from landing on one band count)."""
    workdir.mkdir(parents=True, exist_ok=True)
    side = side_for(tiles)
    chosen = spread(grid_tiles(side), tiles)
    runs: dict[int, dict[str, Any]] = {}
    with rank_read_cache():
        for count in BAND_COUNTS:
            path, spec, bands = scene_of(workdir, count, side)
            model = fast_segmenter(bands)
            total, conv = gflop(model, count)
            clock = ConvClock(first_conv(model))
            predict_seconds(model, clock, read_seconds(path, spec, chosen[:batch_size])[0], batch_size)  # warm-up
            runs[count] = {"path": path, "spec": spec, "bands": bands, "model": model, "clock": clock, "rounds": []}
            runs[count].update(gflop_per_tile=round(total, 2), first_conv_gflop_per_tile=round(conv, 2))
        for _ in range(rounds):
            for run in runs.values():
                images, read_s = read_seconds(run["path"], run["spec"], chosen)
                parts = predict_seconds(run["model"], run["clock"], images, batch_size)
                run["rounds"].append({"read_s": read_s, **parts})
    result = {str(count): band_figures(run, len(chosen)) for count, run in runs.items()}
    base = result[str(BAND_COUNTS[0])]
    for figures in result.values():
        figures["throughput_vs_3"] = round(figures["tiles_per_s"] / base["tiles_per_s"], 3)
        figures["rest_vs_3"] = round(figures["rest_s_per_tile"] / base["rest_s_per_tile"], 3)
    return {
        "bands": result,
        "tiles": len(chosen),
        "side": side,
        "batch_size": batch_size,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "read_cache_mb": read_cache_mb(),
        "model": f"untrained U-Net ResNet-18, {PATCH} px, fp32, batch norms folded, channels_last",
    }


def band_figures(run: dict[str, Any], tiles: int) -> dict[str, Any]:
    """One band count's figures: each part's seconds per tile in its fastest round, and the tiles/s they make."""
    totals = [sum(r.values()) for r in run["rounds"]]
    fastest = {part: min(r[part] for r in run["rounds"]) for part in run["rounds"][0]}
    per_tile = {key.removesuffix("_s") + "_s_per_tile": round(value / tiles, 4) for key, value in fastest.items()}
    spec: ImageSpec = run["spec"]
    return {
        "tiles_per_s": round(tiles / sum(fastest.values()), 3),
        **per_tile,
        "forward_s_per_tile": round((sum(fastest.values()) - fastest["read_s"]) / tiles, 4),
        "rounds_s": [round(t, 3) for t in totals],
        "gflop_per_tile": run["gflop_per_tile"],
        "first_conv_gflop_per_tile": run["first_conv_gflop_per_tile"],
        "dtype": "float32 raw" if spec.raw else "uint8 scaled",
        "names": list(run["bands"].names),
    }


def measure_interleave(workdir: Path, side: int, rounds: int = 3) -> dict[str, Any]:
    """Seconds to read every tile of the same 13-band uint16 raster, pixel- and band-interleaved, all 13 bands and
    4 of them (the fastest of ``rounds`` passes, each over a freshly opened file), under the rank's block cache."""
    workdir.mkdir(parents=True, exist_ok=True)
    files = {kind: write_bands_raster(workdir / f"s2-{kind}.tif", side, 13, "uint16", kind) for kind in INTERLEAVES}
    reads = {"all": tuple(range(1, 14)), "four": FOUR_OF_13}
    specs = {
        (kind, what): resolve_spec(files[kind], list(bands), key="scenes.s2", raw=True)
        for kind in INTERLEAVES
        for what, bands in reads.items()
    }
    tiles = grid_tiles(side)
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in specs}
    with rank_read_cache():
        for _ in range(rounds):
            for key, spec in specs.items():
                seconds[key].append(read_seconds(files[key[0]], spec, tiles)[1])
    result: dict[str, Any] = {}
    for what, bands in reads.items():
        megabytes = side * side * len(bands) * 2 / 1e6  # the bands' pixels as stored (uint16)
        per = {kind: min(seconds[(kind, what)]) for kind in INTERLEAVES}
        result[what] = {
            "bands": list(bands),
            **{f"{kind}_s": round(per[kind], 3) for kind in INTERLEAVES},
            **{f"{kind}_mb_per_s": round(megabytes / per[kind], 1) for kind in INTERLEAVES},
            "band_over_pixel": round(per["band"] / per["pixel"], 3),
            "rounds_s": {kind: [round(s, 3) for s in seconds[(kind, what)]] for kind in INTERLEAVES},
        }
    for kind, path in files.items():
        with rasterio.open(path) as src:
            assert src.interleaving.name.lower() == kind, (path, src.interleaving)
        result[f"{kind}_file_mb"] = round(path.stat().st_size / 1e6, 1)
        path.unlink()
    return {
        **result,
        "side": side,
        "tiles": len(tiles),
        "raster_mb": round(side * side * 13 * 2 / 1e6, 1),
        "block": BLOCK,
        "read_cache_mb": read_cache_mb(),
        "rounds": rounds,
    }


def measure_bands(workdir: Path, tiles: int, batch_size: int, interleave_side: int, rounds: int = 2) -> dict:
    """Both measurements of many bands: prediction throughput by band count (``rounds`` rounds), and reads by
    interleave (3 passes of each: they take a second)."""
    return {
        "throughput": measure_band_throughput(workdir / "bands", tiles, batch_size, rounds),
        "interleave": measure_interleave(workdir / "interleave", interleave_side),
    }
