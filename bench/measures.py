"""The benchmark's measurements. Every figure is a ratio or a time measured in the same run, on this machine.

- fast path: model forward per tile, fp32 at batch 1 (the plain path) vs the prediction fast path (batch norms
  folded, channels_last, autocast as Lightning runs it at the precision ``auto`` resolves to on this CPU,
  ``predict.batch_size`` tiles per batch), on the same preloaded tiles, in alternating rounds (median of the rounds).
- precision: the fast path's seconds per tile in fp32 and in bf16 autocast, same model, batch and preloaded tiles;
  bf16 on few tiles, as a CPU without native bf16 emulates it about 70x slower than fp32.
- agreement: the detections of both paths on the same tiles of a trained model (none: the bench fails).
- efficiency: pure model forward time over a job's tiles (tensors preloaded, warmed up) / that job's wall time
  (process start to exit: imports, model, data, prediction, rank file).
- scaling: the same job on 2 ranks vs 1 rank, one thread per rank (the 1-rank job is bound to one core).
- peak RSS: the window strategy's peak resident set of the rank (workers 0, so every read is in the rank
  process) on 4k, 16k and 32k rasters, predicting the same number of tiles spread over the whole raster.
- merge: ``merge_detections`` over a million boxes from overlapping tiles; manifest: ``build_manifest`` +
  GeoParquet of a 100k x 100k raster.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from jobs import JobResult, run_predict_job
from rasterscale.atomic import write_geoparquet
from rasterscale.config.schema import validate_config
from rasterscale.datasets.tiles import WindowDataset, to_model_input
from rasterscale.grid.manifest import build_manifest, manifest_frame, tile_grid, tiles_from_frame, write_manifest
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.geo import box_pairs, pair_ious
from rasterscale.raster.imagery import resolve_spec
from rasterscale.runtime.precision import BF16, FP16, FP32
from rasterscale.tasks.detection.merge import merge_detections
from rasterscale.tasks.detection.model import load_detector
from rasterscale.tasks.detectors.model import prepare_for_inference
from synthetic import CRS, TRANSFORM, overlapping_detections, tile_windows, write_raster

PATCH, OVERLAP = 400, 80


def timed(section: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a measurement, adding its own wall time and the load average before and after it."""
    load_before, started = os.getloadavg()[0], time.perf_counter()
    result = section()
    result["section_s"] = round(time.perf_counter() - started, 1)
    result["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def read_tiles(raster: Path, tiles: Sequence[Tile]) -> list[torch.Tensor]:
    """The tiles as the model takes them (float in [0, 1]), preloaded."""
    dataset = WindowDataset(raster, tiles, resolve_spec(raster))
    return [to_model_input(dataset[k][0]) for k in range(len(dataset))]


def autocast_dtype(precision: str, device: str = "cpu") -> torch.dtype | None:
    """The dtype Lightning autocasts to at a resolved ``precision`` on ``device`` ("cpu", "cuda"), None for none:
    ``16-mixed`` is fp16 on CUDA and bf16 on a CPU (Lightning turns it into ``bf16-mixed`` there)."""
    if precision == FP32:
        return None
    if precision == BF16 or (precision == FP16 and device == "cpu"):
        return torch.bfloat16
    if precision == FP16:
        return torch.float16
    raise ValueError(f"bench: no autocast for precision {precision!r} (resolve auto first: {FP32}, {BF16} or {FP16})")


def autocast(precision: str, device: str = "cpu") -> contextlib.AbstractContextManager:
    """What Lightning's precision plugin runs predict_step under."""
    dtype = autocast_dtype(precision, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype, cache_enabled=False)


def precision_text(precision: str) -> str:
    """A precision and what it runs as on a CPU, for the results: "32-true: fp32", "bf16-mixed: bf16 autocast"."""
    dtype = autocast_dtype(precision)
    return f"{precision}: " + ("fp32" if dtype is None else f"{str(dtype).removeprefix('torch.')} autocast")


def forward_seconds(model: torch.nn.Module, images: list[torch.Tensor], batch_size: int, precision: str) -> float:
    """Seconds of forward passes over all ``images``, after one untimed warm-up batch."""
    with torch.inference_mode(), autocast(precision):
        model(images[:batch_size])
        started = time.perf_counter()
        for start in range(0, len(images), batch_size):
            model(images[start : start + batch_size])
        return time.perf_counter() - started


def baseline_model(model_file: Path, score_threshold: float | None = None) -> torch.nn.Module:
    model = load_detector(model_file)[0].eval()
    if score_threshold is not None:
        model.score_thresh = score_threshold
    return model


def fast_model(model_file: Path, score_threshold: float | None = None) -> torch.nn.Module:
    return prepare_for_inference(baseline_model(model_file, score_threshold), channels_last=True)


def measure_fastpath(
    model_file: Path, images: list[torch.Tensor], batch_size: int, precision: str, rounds: int = 3
) -> dict:
    """The plain path (fp32, batch 1) against the fast path at ``precision`` (what ``auto`` resolves to)."""
    baseline, fast = baseline_model(model_file), fast_model(model_file)
    per_tile: dict[str, list[float]] = {"baseline": [], "fast": []}
    for _ in range(rounds):
        per_tile["baseline"].append(forward_seconds(baseline, images, 1, FP32) / len(images))
        per_tile["fast"].append(forward_seconds(fast, images, batch_size, precision) / len(images))
    base, quick = statistics.median(per_tile["baseline"]), statistics.median(per_tile["fast"])
    return {
        "speedup": round(base / quick, 3),
        "baseline_s_per_tile": round(base, 4),
        "fast_s_per_tile": round(quick, 4),
        "rounds": {k: [round(v, 4) for v in values] for k, values in per_tile.items()},
        "tiles": len(images),
        "threads": torch.get_num_threads(),
        "precision": precision,
        "baseline": "fp32, batch 1, as built (batch norms, contiguous)",
        "fast": f"auto ({precision_text(precision)}), channels_last, batch norms folded, batch {batch_size}",
    }


def gflop_per_tile(model: torch.nn.Module, image: torch.Tensor) -> float:
    """The model's floating-point operations for one tile (torch's FLOP counter: convolutions and matrix products,
    which are nearly all of a detector's time), in GFLOP: with the seconds per tile, the rate the CPU reaches."""
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model([image])
    return counter.get_total_flops() / 1e9


def measure_precision(
    model_file: Path, images: list[torch.Tensor], batch_size: int, auto: str, batches: int = 1, rounds: int = 3
) -> dict:
    """The fast path's seconds per tile in fp32 and in bf16 autocast on the same ``batches`` batches of ``images``
    (each after one untimed warm-up batch), and ``auto``, what this CPU resolves ``auto`` to. fp32 is the median of
    ``rounds``; bf16 runs once (emulated, it costs about 70x fp32's time)."""
    fast, tiles = fast_model(model_file), images[: batches * batch_size]
    fp32 = [forward_seconds(fast, tiles, batch_size, FP32) / len(tiles) for _ in range(rounds)]
    bf16 = forward_seconds(fast, tiles, batch_size, BF16) / len(tiles)
    median = statistics.median(fp32)
    gflop = gflop_per_tile(fast, tiles[0])
    threads = torch.get_num_threads()
    return {
        "auto": auto,
        "fp32_s_per_tile": round(median, 4),
        "bf16_s_per_tile": round(bf16, 4),
        "bf16_over_fp32": round(bf16 / median, 3),
        "gflop_per_tile": round(gflop, 1),
        "fp32_gflops_per_thread": round(gflop / median / threads, 1),
        "bf16_gflops_per_thread": round(gflop / bf16 / threads, 1),
        "fp32_rounds": [round(v, 4) for v in fp32],
        "fp32_tiles": len(tiles),
        "bf16_tiles": len(tiles),
        "warmup_tiles": min(batch_size, len(tiles)),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "model": "fast path: channels_last, batch norms folded",
    }


def detections(model: torch.nn.Module, images: list[torch.Tensor], batch_size: int, precision: str) -> list[dict]:
    outputs = []
    with torch.inference_mode(), autocast(precision):
        for start in range(0, len(images), batch_size):
            outputs += [
                {k: v.float().numpy() for k, v in out.items()} for out in model(images[start : start + batch_size])
            ]
    return outputs


def best_matches(reference: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each reference box, the other box it overlaps most: (reference index, other index, IoU)."""
    i, j = box_pairs(reference, other)
    ious = pair_ious(reference[i], other[j])
    order = np.lexsort((-ious, i))
    i, j, ious = i[order], j[order], ious[order]
    first = np.r_[True, i[1:] != i[:-1]] if len(i) else np.zeros(0, dtype=bool)
    return i[first], j[first], ious[first]


def measure_agreement(
    model_file: Path, images: list[torch.Tensor], batch_size: int, precision: str, min_iou: float = 0.9
) -> dict:
    """fp32 (plain path) vs fast path (at ``precision``, what ``auto`` resolves to) detections on the same tiles:
    boxes matched at IoU >= min_iou (each way) and score differences of the matched boxes. Unmatched boxes near the
    score threshold are counted apart: a score moving by 0.01 across the threshold adds or drops a box."""
    plain, quick = baseline_model(model_file), fast_model(model_file)
    reference = detections(plain, images, 1, FP32)
    fast = detections(quick, images, batch_size, precision)
    score_threshold = plain.score_thresh
    counts = {"fp32": 0, "fast": 0, "fp32_matched": 0, "fast_matched": 0, "unmatched_near_threshold": 0}
    diffs, ious = [], []
    for ref, out in zip(reference, fast, strict=True):
        counts["fp32"] += len(ref["boxes"])
        counts["fast"] += len(out["boxes"])
        for a, b, name in ((ref, out, "fp32"), (out, ref, "fast")):
            i, j, iou = best_matches(a["boxes"], b["boxes"])
            good = (iou >= min_iou) & (a["labels"][i] == b["labels"][j])
            counts[f"{name}_matched"] += int(good.sum())
            unmatched = np.setdiff1d(np.arange(len(a["boxes"])), i[good])
            counts["unmatched_near_threshold"] += int((a["scores"][unmatched] < score_threshold + 0.02).sum())
            if name == "fp32":
                diffs += np.abs(a["scores"][i[good]] - b["scores"][j[good]]).tolist()
                ious += iou[good].tolist()
    if not counts["fp32"] or not counts["fast"]:
        raise RuntimeError(
            f"fp32 agreement: {model_file} found {counts['fp32']} boxes in fp32 and {counts['fast']} on the fast path "
            f"over {len(images)} tiles: a figure over no boxes is no figure (is the model trained for this scene?)"
        )
    return {
        "model": "trained",
        "model_file": str(model_file),
        "tiles": len(images),
        "precision": precision,
        "score_threshold": score_threshold,
        "min_iou": min_iou,
        **counts,
        "fp32_matched_fraction": round(counts["fp32_matched"] / max(1, counts["fp32"]), 4),
        "fast_matched_fraction": round(counts["fast_matched"] / max(1, counts["fast"]), 4),
        "score_abs_diff_mean": round(float(np.mean(diffs)), 5) if diffs else None,
        "score_abs_diff_max": round(float(np.max(diffs)), 5) if diffs else None,
        "matched_iou_mean": round(float(np.mean(ious)), 5) if ious else None,
    }


def job_summary(job: JobResult) -> dict:
    return {
        "job_wall_s": round(job.wall_s, 2),
        "tiles": job.tiles,
        "ranks": [
            {k: p[k] for k in ("rank", "threads", "workers", "tiles", "wall_s", "compute_s", "output_s", "wait_s")}
            | {"tiles_per_s": p["tiles_per_s"], "precision": p["precision"]}
            for p in job.profiles
        ],
    }


def measure_efficiency(
    workdir: Path, raster: Path, manifest: Path, model_file: Path, tiles: list[Tile], precision: str
) -> dict:
    """Pure forward time over the job's tiles against the job's wall, and where the in-loop rest goes: the rank's
    batches (``compute_s``: the forward plus the first batch's warm-up and any slowdown), its outputs taking the
    boxes (``output_s``), its waits for data (``wait_s``), and the same job without a reading worker (``workers 0``:
    nothing else runs on the cores). The job runs at ``predict.precision: auto``, the forward at ``precision``, what
    ``auto`` resolves to here (each rank's profile records the value it ran at)."""
    predict = {"devices": 1, "workers": 1, "batch_size": 4}
    job = run_predict_job(workdir / "efficiency", raster, manifest, model_file, predict)
    alone = run_predict_job(workdir / "efficiency-workers0", raster, manifest, model_file, {**predict, "workers": 0})
    threads = job.profiles[0]["threads"]
    torch.set_num_threads(threads)
    images = read_tiles(raster, tiles)
    forward = forward_seconds(fast_model(model_file), images, predict["batch_size"], precision)
    del images
    profile, profile_alone = job.profiles[0], alone.profiles[0]
    return {
        "efficiency": round(forward / job.wall_s, 4),
        "forward_s": round(forward, 2),
        "in_loop_efficiency": round(forward / profile["wall_s"], 4),
        "in_loop": {
            "compute_over_forward_s": round(profile["compute_s"] - forward, 2),
            "output_s": profile["output_s"],
            "wait_s": profile["wait_s"],
            "workers0_in_loop_efficiency": round(forward / profile_alone["wall_s"], 4),
            "workers0_compute_over_forward_s": round(profile_alone["compute_s"] - forward, 2),
            "workers0_wait_s": profile_alone["wait_s"],
            "workers0_job_wall_s": round(alone.wall_s, 2),
        },
        "startup_and_write_s": round(job.wall_s - profile["wall_s"], 2),
        "threads": threads,
        "precision": precision,
        **job_summary(job),
    }


def measure_scaling(workdir: Path, raster: Path, manifest: Path, model_file: Path) -> dict:
    one = run_predict_job(workdir / "one", raster, manifest, model_file, {"devices": 1, "workers": 1}, cores={0})
    two = run_predict_job(workdir / "two", raster, manifest, model_file, {"devices": 2, "workers": 1})
    threads = [p["threads"] for p in one.profiles + two.profiles]
    throughput_one = sum(p["tiles_per_s"] for p in one.profiles)
    throughput_two = sum(p["tiles_per_s"] for p in two.profiles)
    return {
        "scaling": round(one.wall_s / two.wall_s, 4),
        "throughput_scaling": round(throughput_two / throughput_one, 4),
        "threads_per_rank": threads,
        "one_rank": job_summary(one),
        "two_ranks": job_summary(two),
    }


def spread(items: Sequence[Any], count: int) -> list[Any]:
    """``count`` items evenly spread over the sequence (first and last included)."""
    picks = np.unique(np.linspace(0, len(items) - 1, min(count, len(items))).round().astype(int))
    return [items[k] for k in picks]


def predict_spread_tiles(
    directory: Path, side: int, count: int, model_file: Path, predict: dict, config: dict | None = None
) -> tuple[JobResult, int]:
    """A one-job prediction over ``count`` tiles spread over a raster ``side`` px square (only their pixels are
    written, the raster removed after); the job and the tiles of the raster's whole manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS)
    chosen = manifest.iloc[spread(range(len(manifest)), count)]
    raster = write_raster(directory / "raster.tif", side, only=tile_windows(tiles_from_frame(chosen)))
    write_manifest(chosen, resolve_spec(raster), TileGrid(PATCH, OVERLAP), directory / "tiles.parquet")
    job = run_predict_job(directory, raster, directory / "tiles.parquet", model_file, predict, config=config)
    raster.unlink()
    return job, len(manifest)


def measure_rss(workdir: Path, model_file: Path, sides: Sequence[int], count: int) -> dict:
    """Peak RSS of a window-strategy rank on rasters of each side, the same tiles count spread over each."""
    result: dict[str, Any] = {}
    for side in sides:
        job, manifest_tiles = predict_spread_tiles(
            workdir / f"rss-{side}", side, count, model_file, {"devices": 1, "workers": 0}
        )
        profile = job.profiles[0]
        result[str(side)] = {
            "rss_peak_mb": profile["host_rss_peak_mb"],
            "rss_mean_per_batch_mb": profile["memory_mean_mb"],
            "manifest_tiles": manifest_tiles,
            "predicted_tiles": profile["tiles"],
            "job_wall_s": round(job.wall_s, 2),
        }
    return result


def measure_merge(n_objects: int, side: int = 40_000) -> dict:
    """``merge_detections`` (cut-box removal and cross-tile NMS) over the boxes of ``n_objects`` objects."""
    manifest = manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS)
    boxes = overlapping_detections(manifest, side, n_objects)
    started = time.perf_counter()
    merged = merge_detections(boxes, manifest, side, side, **validate_config({})["merge"])
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "boxes": len(boxes), "kept": len(merged), "tiles": len(manifest)}


def measure_manifest(workdir: Path, side: int = 100_000) -> dict:
    raster = write_raster(workdir / "manifest.tif", side, only=[])
    started = time.perf_counter()
    manifest = build_manifest(raster, PATCH, OVERLAP)
    write_geoparquet(manifest, workdir / "manifest.parquet")
    seconds = time.perf_counter() - started
    raster.unlink()
    return {"seconds": round(seconds, 3), "tiles": len(manifest), "side": side}
