"""make bench-gpu's measurements: every figure is measured in one run, on this machine's devices.

- train: the real training job (scripts/train.py) on a scene of the demo synthesizer, one rank per GPU, a few dozen
  steps at ``auto`` and at ``32-true``; the steady rate is the median of rank 0's progress intervals after the first
  (which holds the ranks' start and warm-up).
- predict: the real prediction job (scripts/predict.py) over a larger synthetic scene (a demo scene repeated), one
  rank per GPU, at ``auto`` and at ``32-true``, with the model the ``auto`` training wrote; every rank's profile
  (tiles/s, data wait, NVML utilization, peak memory, precision) from its rank record.
- forward: the same model's pure forward as the job runs it (uint8 batches already on the device, scaled there,
  the batched RetinaNet of :mod:`rasterscale.tasks.detection.batched`: pre-processing, network, anchors and NMS;
  no reading, no outputs) at batch 16 and 32 at what ``auto`` resolves to and at ``32-true``, against the
  prediction job's tiles/s per rank; and the boxes at ``auto`` against those at ``32-true`` (the precision's own
  effect).
- compile: ``torch.compile`` of the backbone, FPN and head (static shapes, full batches; anchors and NMS stay
  eager), each mode (``default``; ``reduce-overhead``: CUDA graphs) at ``auto`` and at ``32-true``, each against
  the eager path of the same precision on the same tiles, each mode in a process of its own (a compiler that hangs
  or crashes costs only that mode's rows): kept only if it is faster and finds the same boxes (matched at a high
  IoU), so that compile's effect is judged apart from the precision's.
- instances: an untrained Mask R-CNN of the same backbone and scale (every tile at its cap of instances): the
  prediction job (``task: instances``) at ``auto`` on every rank against the model's pure forward as the job runs
  it (the batched Mask R-CNN of :mod:`rasterscale.tasks.instances.batched`, masks pasted and thresholded).
- copy: host to device copy rate of a prediction batch of uint8 tiles, pinned (non-blocking, as a GPU job
  copies) and pageable, beside the prediction job's data-wait fraction.

Without CUDA the same functions run on tiny sizes (:data:`CPU`): CPU ranks, a ResNet-18, 128 px tiles, and
``torch.compile`` with the ``eager`` backend (it checks the capture of the graphs, not the compiler's speed).
Every section fails soft: its error is its result, and the others still run.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
import torch
from rasterio.windows import Window

from host_ceiling import measure_host_ceiling, measure_unet_job
from jobs import JobResult, TrainResult, predict_config, run_predict_job, run_train_job
from measures import best_matches, fast_model, spread
from rasterscale.config.schema import validate_config
from rasterscale.datasets.tiles import WindowDataset, to_model_input
from rasterscale.grid.manifest import build_manifest, read_manifest, tiles_from_frame, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.jobs.profile import summarize
from rasterscale.predict.profile import MB, UtilizationSampler
from rasterscale.raster.imagery import read_spec, resolve_spec
from rasterscale.runtime import precision as precisions
from rasterscale.runtime.ranks import cpu_threads_per_rank, precision_plugin
from rasterscale.settings import job_settings
from rasterscale.tasks.api import Task
from rasterscale.tasks.detection.batched import BatchDetections
from rasterscale.tasks.detection.rankoutput import detections_to_host
from rasterscale.tasks.detection.task import DetectionTask
from rasterscale.tasks.instances.task import InstancesTask
from rasterscale.tools.synth import synthesize_scene
from synthetic import write_detector, write_instance_model

PRECISIONS = (precisions.AUTO, precisions.FP32)  # auto first: its trained model is the one predicted
SCORE_THRESHOLD = 0.3  # the prediction jobs' and the pure forward's (the model's default)
# score thresholds of the boxes compared, the first at which the eager model finds a box a tile (a briefly trained
# model's scores are low; at 0 every tile gives its detections_per_tile best boxes)
COMPILE_SCORE_THRESHOLDS = (0.05, 0.01, 0.0)
MIN_IOU = 0.9  # a box is the same box at IoU >= this (and the same label)
SAME_BOXES = 0.99  # "the same boxes": at least this fraction matched, each way
KEEP_SPEEDUP = 1.05  # compile is kept from this speedup (timing noise is a few %)
TRAIN_SCENE = "bench_train"
PIXEL_SIZE = 0.1  # the demo's ground sample distance (m)


@dataclass(frozen=True)
class Sizes:
    """Every size of a run. The defaults are the GPU run's (not yet timed whole: 6 to 8 minutes estimated on one
    H100, docs/performance.md): DeepForest's model and input scale (RetinaNet-ResNet50, 400 px tiles seen at
    800 px)."""

    backbone: str = "resnet50"
    patch: int = 400
    overlap: int = 80
    resize: tuple[int, int] | None = (800, 1333)  # DeepForest's: torchvision's min_size, max_size
    train_side: int = 2048  # the demo synthesizer's scene trained on (49 tiles)
    train_steps: int = 40
    train_batch_per_rank: int = 16
    train_workers: int = 6
    log_every: int = 5
    validation_fraction: float = 0.25  # the training scene's bottom quarter: a row of tiles, validated once at the end
    predict_side: int = 2048  # the demo synthesizer's scene predicted, ...
    predict_repeats: int = 8  # ... repeated 8 x 8 into one raster of 16384 px a side (2601 tiles)
    predict_batch: int = 16
    predict_workers: int = 6
    forward_batches: tuple[int, ...] = (16, 32)
    forward_tiles: int = 256  # preloaded tiles of a timed round
    rounds: int = 3  # timed rounds (the median counts)
    compile_backend: str = "inductor"
    compile_modes: tuple[str | None, ...] = (None, "reduce-overhead")  # None: torch.compile's default mode
    compile_tiles: int = 128
    copy_rounds: int = 50
    cpu_ranks: int = 2  # ranks of a CPU run (a GPU run has one rank per visible GPU)
    train_ranks: int = 0  # ranks of the training jobs (0: the run's)
    job_timeout_s: int = 300
    compile_timeout_s: int = 240
    ceiling_side: int = 8192  # the null model's scene (1369 tiles of 256 px): the host ceiling on the GPU node
    unet_side: int = 8192  # the U-Net segmenter's scene: its job against its pure forward
    unet_batch: int = 32


GPU = Sizes()
CPU = Sizes(
    backbone="resnet18",
    patch=64,
    overlap=8,
    resize=(128, 213),  # DeepForest's 2x scale
    train_side=256,
    train_steps=3,  # 3 progress lines: a steady rate from the 2nd on
    train_batch_per_rank=2,
    train_workers=0,
    log_every=1,
    predict_side=128,
    predict_repeats=2,  # 256 px a side: 25 tiles, 12-13 a rank
    predict_batch=4,
    predict_workers=1,
    forward_batches=(2, 4),
    forward_tiles=4,
    rounds=2,
    compile_backend="eager",
    compile_modes=(None,),  # the eager backend takes no mode
    compile_tiles=4,  # one batch of predict_batch
    copy_rounds=20,
    job_timeout_s=240,
    compile_timeout_s=120,
    ceiling_side=512,
    unet_side=512,
    unet_batch=4,
    train_ranks=1,  # a second CPU rank would double the training job's start, the bulk of its time here
)


def brief(err: BaseException) -> str:
    """An error in one line: its type, its first line and, for a job's stderr tail, its last line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] != text:
        text = f"{text} ... {lines[-1]}"
    return f"{type(err).__name__}: {text}"[:400]


def attempt(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A measurement's result, or its error (never raised: one broken measurement must not lose the others)."""
    started = time.perf_counter()
    try:
        result = measure()
    except Exception as err:
        result = {"error": brief(err), "traceback": traceback.format_exc()[-6000:]}
    result["section_s"] = round(time.perf_counter() - started, 1)
    return result


def ok(result: dict[str, Any] | None) -> bool:
    return result is not None and "error" not in result


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator > 0 else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accelerator_of(device: torch.device) -> str:
    return "gpu" if device.type == "cuda" else "cpu"


def workers_per_rank(wanted: int, ranks: int) -> int:
    """Dataloader workers of each rank: as wanted, within the cores the ranks share (one core left to each)."""
    return max(0, min(wanted, len(os.sched_getaffinity(0)) // ranks - 1))


# --- inputs ---------------------------------------------------------------------------------------------------


def write_scene_manifest(raster: Path, sizes: Sizes) -> Path:
    manifest = raster.with_suffix(".parquet")
    grid = TileGrid(sizes.patch, sizes.overlap)
    write_manifest(build_manifest(raster, grid.patch_size, grid.overlap), resolve_spec(raster), grid, manifest)
    return manifest


def repeat_raster(source: Path, path: Path, repeats: int) -> Path:
    """A tiled GeoTIFF of ``repeats`` x ``repeats`` copies of ``source`` (its blocks, compression and CRS): a large
    scene of real-looking crowns for the price of a small one."""
    with rasterio.open(source) as src:
        pixels, profile = src.read(), dict(src.profile)
    _, height, width = pixels.shape
    profile.update(width=width * repeats, height=height * repeats, bigtiff="if_safer", num_threads="all_cpus")
    with rasterio.open(path, "w", **profile) as dst:
        for row in range(repeats):
            for col in range(repeats):
                dst.write(pixels, window=Window(col * width, row * height, width, height))
    return path


@dataclass
class Bench:
    """One run: where it works, its sizes, its ranks and device, what ``auto`` resolves to there, and what the
    sections hand on (the trained model, the ``auto`` prediction job's result)."""

    workdir: Path
    sizes: Sizes
    accelerator: str  # "gpu" or "cpu"
    ranks: int
    auto: str  # what precision auto resolves to on this device
    trained: Path | None = None
    trained_at: str = ""  # the precision of the training that wrote ``trained``
    predicted: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.accelerator == "gpu" else torch.device("cpu")

    @property
    def train_ranks(self) -> int:
        return self.sizes.train_ranks or self.ranks

    @property
    def threads(self) -> int:
        """Threads of one CPU rank (the in-process measurements run as one rank does); GPU runs: unchanged."""
        return cpu_threads_per_rank(self.ranks) if self.accelerator == "cpu" else torch.get_num_threads()

    @functools.cached_property
    def train_scene(self) -> dict[str, Any]:
        """The demo synthesizer's training scene, with its crown boxes and tile manifest (Scene fields)."""
        raster, boxes = self.workdir / "train.tif", self.workdir / "train.gpkg"
        side = self.sizes.train_side
        synthesize_scene(raster, boxes, width=side, height=side, seed=1, pixel_size=PIXEL_SIZE)
        manifest = write_scene_manifest(raster, self.sizes)
        return {"name": TRAIN_SCENE, "raster": str(raster), "manifest": str(manifest), "annotations": str(boxes)}

    @functools.cached_property
    def predict_scene(self) -> tuple[Path, Path]:
        """The predicted raster (a demo scene of another seed, repeated) and its tile manifest."""
        side = self.sizes.predict_side
        source, boxes = self.workdir / "predict-source.tif", self.workdir / "predict-source.gpkg"
        synthesize_scene(source, boxes, width=side, height=side, seed=2, pixel_size=PIXEL_SIZE)
        raster = repeat_raster(source, self.workdir / "predict.tif", self.sizes.predict_repeats)
        return raster, write_scene_manifest(raster, self.sizes)

    @functools.cached_property
    def untrained(self) -> Path:
        """A seeded untrained model of the same architecture and scale, for when training failed."""
        s = self.sizes
        return write_detector(self.workdir / "untrained.pt", s.backbone, s.patch, resize=s.resize)

    @property
    def model_file(self) -> Path:
        return self.trained if self.trained is not None else self.untrained

    @property
    def model_kind(self) -> str:
        return f"trained (the {self.trained_at} training's)" if self.trained is not None else "untrained (no training)"


def make_bench(workdir: Path, cpu: bool = False) -> Bench:
    """The run on every visible GPU, or (none, or ``cpu``) the short CPU run."""
    gpus = 0 if cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    accelerator, sizes, ranks = ("gpu", GPU, gpus) if gpus else ("cpu", CPU, CPU.cpu_ranks)
    auto = precisions.choose(precisions.probe(accelerator, 0))
    return Bench(workdir, sizes, accelerator, ranks, auto)


# --- train ----------------------------------------------------------------------------------------------------


def resize_key(resize: tuple[int, int] | None) -> Any:
    return {"min_size": resize[0], "max_size": resize[1]} if resize else "native"


def train_config(bench: Bench, precision: str) -> dict[str, Any]:
    """The sections the train rule's job file carries (the training scene's entry among them): a few dozen
    steps, one validation after the last (rank 0's, with the model where it trained: a GPU training's validation,
    after the last progress line, so outside the steady rate), no resume checkpoints."""
    s, scene = bench.sizes, bench.train_scene
    config = validate_config(
        {
            "scenes": {TRAIN_SCENE: {"path": scene["raster"], "annotations": scene["annotations"]}},
            "tiling": {"patch_size": s.patch, "overlap": s.overlap},
            "model": {"name": "bench", "backbone": s.backbone, "resize": resize_key(s.resize)},
            "train": {
                "scenes": [TRAIN_SCENE],
                "accelerator": bench.accelerator,
                "devices": bench.train_ranks,
                "batch_size": s.train_batch_per_rank * bench.train_ranks,
                "epochs": 100_000,
                "max_steps": s.train_steps,
                "precision": precision,
                "workers": workers_per_rank(s.train_workers, bench.train_ranks),
                "validation_fraction": s.validation_fraction,
                "val_every_n_epochs": 100_000,  # only after the last step
                "log_every_n_steps": s.log_every,
                "checkpoint_every_n_steps": 0,
            },
        }
    )
    sections = {name: config[name] for name in ("task", "model", "tiling", "train")}
    return {**sections, "scenes": {TRAIN_SCENE: config["scenes"][TRAIN_SCENE]}}  # the training scene's entry


def train_summary(job: TrainResult, config: dict[str, Any]) -> dict[str, Any]:
    train = config["train"]
    step = job.steady_step_s
    return {
        "requested": train["precision"],
        "precision": job.meta.get("precision"),
        "ranks": train["devices"],
        "batch": train["batch_size"],
        "workers": train["workers"],
        "steps": job.meta.get("steps"),
        "step_ms": round(1000 * step, 1),
        "steps_per_s": round(1 / step, 3),
        "images_per_s": round(train["batch_size"] / step, 2),
        "fit_s": job.meta.get("seconds"),
        "validation": job.meta.get("validation") or {},
        "job_wall_s": round(job.wall_s, 2),
        "progress": job.progress,
    }


def train_once(bench: Bench, precision: str) -> dict[str, Any]:
    config = train_config(bench, precision)
    # CPU ranks of one thread each, as the CPU prediction job's (OpenMP threads of a rank that share a core with
    # other work wait for each other at every barrier)
    cores = range(bench.train_ranks) if bench.accelerator == "cpu" else None
    workdir = bench.workdir / f"train-{precision}"
    job = run_train_job(workdir, [bench.train_scene], config, cores, bench.sizes.job_timeout_s)
    if bench.trained is None:  # the auto training's model, or the 32-true one's where auto's failed
        bench.trained, bench.trained_at = job.model, precision
    return train_summary(job, config)


def at_each_precision(bench: Bench, once: Callable[[Bench, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A job run by ``once`` at each of :data:`PRECISIONS`, failing soft; where ``auto`` resolves to 32-true on this
    device (a CPU without native bf16) the two are the same job: its one run stands for both (``one_run``)."""
    runs = {precisions.AUTO: attempt(functools.partial(once, bench, precisions.AUTO))}
    auto = runs[precisions.AUTO]
    if bench.auto == precisions.FP32 and ok(auto):
        runs[precisions.FP32] = {**auto, "requested": precisions.FP32, "one_run": True}
    else:
        runs[precisions.FP32] = attempt(functools.partial(once, bench, precisions.FP32))
    return runs


def one_run(runs: dict[str, dict[str, Any]]) -> bool:
    """Whether one run stands for both precisions (:func:`at_each_precision`): no speedup to report."""
    return any(run.get("one_run") for run in runs.values())


def measure_train(bench: Bench) -> dict[str, Any]:
    """Training at ``auto`` and at ``32-true``: steady steps/s and images/s, and auto's speedup per step."""
    runs = at_each_precision(bench, train_once)
    result: dict[str, Any] = {"runs": runs, "model": describe_model(bench.sizes)}
    auto, fp32 = runs[precisions.AUTO], runs[precisions.FP32]
    if ok(auto) and ok(fp32) and not one_run(runs):
        result["auto_speedup"] = ratio(fp32["step_ms"], auto["step_ms"])
    return result


def describe_model(sizes: Sizes) -> str:
    scale = f"seen at {sizes.resize[0]} px" if sizes.resize else "native scale"
    return f"RetinaNet-{sizes.backbone}, {sizes.patch} px tiles {scale}"


# --- predict --------------------------------------------------------------------------------------------------

RANK_KEYS = (
    "rank",
    "device",
    "precision",
    "batch_size",
    "workers",
    "threads",
    "tiles",
    "wall_s",
    "tiles_per_s",
    "wait_fraction",
    "output_fraction",
    "utilization",
    "utilization_source",
    "memory_kind",
    "memory_peak_mb",
    "memory_mean_mb",
    "host_rss_peak_mb",
)


def job_summary(job: JobResult) -> dict[str, Any]:
    """A prediction job's wall, its totals and every rank's profile (:mod:`rasterscale.predict.profile`)."""
    profile = summarize(job.profiles)
    total = profile["total"]
    return {
        "job_wall_s": round(job.wall_s, 2),
        **{key: total[key] for key in ("tiles", "tiles_per_s", "wait_fraction", "output_fraction", "memory_peak_mb")},
        "ranks": [{key: rank.get(key) for key in RANK_KEYS} for rank in profile["ranks"]],
    }


def job_predict(bench: Bench, precision: str, ranks: int) -> dict[str, Any]:
    """A prediction job's ``predict`` section: ``ranks`` ranks at ``precision``, the run's batch and workers."""
    s = bench.sizes
    return {
        "accelerator": bench.accelerator,
        "devices": ranks,
        "batch_size": s.predict_batch,
        "workers": workers_per_rank(s.predict_workers, ranks),
        "precision": precision,
    }


def predict_once(bench: Bench, precision: str, ranks: int | None = None) -> dict[str, Any]:
    """The prediction job at ``precision`` on ``ranks`` ranks (the run's: one per visible GPU)."""
    s = bench.sizes
    ranks = ranks or bench.ranks
    raster, manifest = bench.predict_scene
    predict = job_predict(bench, precision, ranks)
    config = predict_config(predict, SCORE_THRESHOLD, {"patch_size": s.patch, "overlap": s.overlap})
    workdir = bench.workdir / f"predict-{precision}-{ranks}"
    job = run_predict_job(workdir, raster, manifest, bench.model_file, predict, timeout=s.job_timeout_s, config=config)
    summary = job_summary(job)
    used = ", ".join(sorted({str(rank["precision"]) for rank in summary["ranks"]}))  # one value: the ranks agree
    return {"requested": precision, "precision": used, **summary}


def measure_predict(bench: Bench) -> dict[str, Any]:
    """The prediction job at ``auto`` and at ``32-true``: tiles/s, and every rank's profile."""
    runs = at_each_precision(bench, predict_once)
    auto, fp32 = runs[precisions.AUTO], runs[precisions.FP32]
    result: dict[str, Any] = {"runs": runs, "model": f"{describe_model(bench.sizes)}, {bench.model_kind}"}
    if ok(auto):
        bench.predicted = auto
    if ok(auto) and ok(fp32) and not one_run(runs):
        result["auto_speedup"] = ratio(auto["tiles_per_s"], fp32["tiles_per_s"])
    result["scaling"] = attempt(functools.partial(measure_scaling, bench))
    return result


def measure_scaling(bench: Bench) -> dict[str, Any]:
    """The ``auto`` job on one rank against the job on all of the run's (one per visible GPU): tiles/s, and that
    ratio over the ranks (1.0: every rank as fast as one alone). One GPU: not measured, and said so."""
    if bench.ranks == 1:
        return {"ranks": 1, "note": f"one {bench.accelerator.upper()} visible: the job on several is not measured"}
    if bench.predicted is None:
        return {"ranks": bench.ranks, "note": "no auto prediction job on every rank to compare (it failed)"}
    one = predict_once(bench, precisions.AUTO, ranks=1)
    speedup = ratio(bench.predicted["tiles_per_s"], one["tiles_per_s"])
    return {
        "ranks": bench.ranks,
        "one_rank_tiles_per_s": one["tiles_per_s"],
        "all_ranks_tiles_per_s": bench.predicted["tiles_per_s"],
        "speedup": speedup,
        "efficiency": ratio(speedup, bench.ranks) if speedup is not None else None,
    }


# --- forward --------------------------------------------------------------------------------------------------


def device_tiles(raster: Path, manifest: Path, count: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` uint8 tiles spread over the manifest, read as the job reads them, already on ``device``."""
    tiles = spread(tiles_from_frame(read_manifest(manifest)), count)
    dataset = WindowDataset(raster, tiles, read_spec(manifest))
    return [dataset[k][0].to(device) for k in range(len(dataset))]


def detector(model_file: Path, device: torch.device, score_threshold: float) -> torch.nn.Module:
    """The model on the prediction job's fast path (:func:`rasterscale.tasks.detection.task.prepare_for_inference`)."""
    return fast_model(model_file, score_threshold).to(device)


def full_batches(images: Sequence[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """The tiles as full batches of ``batch``, each one tensor (as the job's dataloader hands them over)."""
    batches = [torch.stack(list(images[k : k + batch])) for k in range(0, len(images) - batch + 1, batch)]
    if not batches:
        raise ValueError(f"{len(images)} tiles make no batch of {batch}")
    return batches


TASK = DetectionTask()
CUDA_GRAPH_STEPS = "cuda_graph_steps"  # a compiled model's flag: its batches are CUDA graph trees' iterations


def run_batch(model: torch.nn.Module, batch: torch.Tensor, task: Task = TASK) -> Any:
    """The model over a batch of uint8 tiles on its device as the prediction job runs it: scaled there, then the
    task's forward and post-processing (detection's batched RetinaNet, unless ``task`` says otherwise). A model
    compiled into CUDA graphs (:func:`compile_detector`) begins an iteration of CUDA graph trees here: left to
    itself, each compiled call (the backbone's, then the head's) would begin one, and the head's would free the
    backbone's outputs it reads (pytorch/pytorch#160281)."""
    if getattr(model, CUDA_GRAPH_STEPS, False):
        torch.compiler.cudagraph_mark_step_begin()
    return task.postprocess(task.forward(model, to_model_input(batch)))


@contextlib.contextmanager
def predicting(precision: str, device: torch.device) -> Iterator[None]:
    """What Lightning runs predict_step under: inference mode and the precision plugin's autocast."""
    with torch.inference_mode(), precision_plugin(precision, accelerator_of(device)).predict_step_context():
        yield


def timed_pass(
    model: torch.nn.Module, batches: Sequence[torch.Tensor], device: torch.device, task: Task = TASK
) -> float:
    """Seconds of one pass over the batches (the device synchronized before and after)."""
    synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        run_batch(model, batch, task)
    synchronize(device)
    return time.perf_counter() - started


def forward_rate(
    model: torch.nn.Module, images: Sequence[torch.Tensor], batch: int, precision: str, rounds: int, task: Task = TASK
) -> float:
    """Tiles per second of the pure forward at ``batch`` as ``task``'s job runs it (median of ``rounds`` passes,
    after a warm-up batch)."""
    device = images[0].device
    batches = full_batches(images, batch)
    with predicting(precision, device):
        run_batch(model, batches[0], task)
        seconds = statistics.median(timed_pass(model, batches, device, task) for _ in range(rounds))
    return len(batches) * batch / seconds


def utilization_sampler(device: torch.device) -> UtilizationSampler | None:
    """NVML's busy fraction of the device, sampled while the forward runs (as the job's profiler samples it)."""
    return UtilizationSampler(device).start() if device.type == "cuda" else None


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_forward(bench: Bench) -> dict[str, Any]:
    """The pure forward at each batch of ``forward_batches`` against the ``auto`` prediction job's tiles/s."""
    s, device = bench.sizes, bench.device
    torch.set_num_threads(bench.threads)
    torch.backends.cudnn.benchmark = True  # as the prediction job runs (all tiles have one size)
    raster, manifest = bench.predict_scene
    images = device_tiles(raster, manifest, s.forward_tiles, device)
    model = detector(bench.model_file, device, SCORE_THRESHOLD)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampler = utilization_sampler(device)
    rates = {
        str(batch): round(forward_rate(model, images, batch, bench.auto, s.rounds), 2) for batch in s.forward_batches
    }
    utilization = sampler.stop() if sampler is not None else None
    largest = max(s.forward_batches)
    fp32 = round(forward_rate(model, images, largest, precisions.FP32, s.rounds), 2)
    batches = full_batches(images, largest)
    result: dict[str, Any] = {
        "precision": bench.auto,
        "fp32_tiles_per_s": {str(largest): fp32},
        "auto_over_fp32": ratio(rates[str(largest)], fp32),
        "precision_agreement": precision_agreement(model, batches, bench.auto),
        "device": str(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "tiles": len(images),
        "rounds": s.rounds,
        "model": f"{describe_model(s)}, {bench.model_kind}",
        "tiles_per_s": rates,
        "utilization": round(utilization, 4) if utilization is not None else None,
        "memory_peak_mb": round(torch.cuda.max_memory_allocated(device) / MB, 1) if device.type == "cuda" else None,
    }
    del model, images
    release(device)
    result.update(against_job(bench.predicted, rates, s.predict_batch))
    return result


def precision_agreement(model: torch.nn.Module, batches: Sequence[torch.Tensor], precision: str) -> dict[str, Any]:
    """The boxes at ``precision`` (``auto``'s) against those at ``32-true``, eager both (the precision's own effect
    on the boxes, apart from any compiler's), at the first of :data:`COMPILE_SCORE_THRESHOLDS` where fp32 finds a box
    a tile."""
    kept = model.score_thresh
    try:
        threshold, reference = reference_boxes(model, batches, precisions.FP32)
        with predicting(precision, batches[0].device):
            other = detections_of(model, batches)
    finally:
        model.score_thresh = kept
    return {"precision": precision, "score_threshold": threshold, **box_agreement(reference, other)}


def against_job(job: dict[str, Any] | None, rates: dict[str, float], batch: int) -> dict[str, Any]:
    """The prediction job's tiles/s per rank over the pure forward's at the job's batch."""
    if job is None:
        return {"job_over_forward": None, "job_note": "no auto prediction job to compare (it failed)"}
    if str(batch) not in rates:
        return {"job_over_forward": None, "job_note": f"no pure forward at the job's batch {batch}"}
    per_rank = [rank["tiles_per_s"] for rank in job["ranks"] if rank["tiles"]]
    return {
        "job_batch": batch,
        "job_rank_tiles_per_s": per_rank,
        "job_over_forward": ratio(statistics.mean(per_rank), rates[str(batch)]),
    }


# --- compile --------------------------------------------------------------------------------------------------


def compile_detector(model: torch.nn.Module, backend: str, mode: str | None = None) -> torch.nn.Module:
    """The detector with its backbone (ResNet and FPN) and its head compiled (static shapes; ``mode``:
    torch.compile's, ``reduce-overhead`` for CUDA graphs); the pre-processing, the anchors and the post-processing
    (score filter, box decoding, NMS) stay eager."""
    options: dict[str, Any] = {"backend": backend, "dynamic": False}
    if mode is not None:
        options["mode"] = mode
    model.backbone = torch.compile(model.backbone, **options)
    model.head = torch.compile(model.head, **options)
    setattr(model, CUDA_GRAPH_STEPS, mode == "reduce-overhead")  # :func:`run_batch` marks each batch's iteration
    return model


def numpy_detections(outputs: BatchDetections) -> list[dict[str, np.ndarray]]:
    return [{"boxes": tile.boxes, "scores": tile.scores, "labels": tile.labels} for tile in detections_to_host(outputs)]


def box_agreement(reference: list[dict], other: list[dict], min_iou: float = MIN_IOU) -> dict[str, Any]:
    """Boxes of ``other`` matched to ``reference``'s at IoU >= min_iou with the same label, each way, tile by tile;
    and the score differences of the matched boxes."""
    counts = {"reference": 0, "other": 0, "reference_matched": 0, "other_matched": 0}
    diffs: list[float] = []
    for ref, out in zip(reference, other, strict=True):
        counts["reference"] += len(ref["boxes"])
        counts["other"] += len(out["boxes"])
        for a, b, name in ((ref, out, "reference"), (out, ref, "other")):
            i, j, iou = best_matches(a["boxes"], b["boxes"])
            good = (iou >= min_iou) & (a["labels"][i] == b["labels"][j])
            counts[f"{name}_matched"] += int(good.sum())
            if name == "reference":
                diffs += np.abs(a["scores"][i[good]] - b["scores"][j[good]]).tolist()
    fractions = {
        f"{name}_matched_fraction": round(counts[f"{name}_matched"] / counts[name], 4) if counts[name] else None
        for name in ("reference", "other")
    }
    same = all(f is not None and f >= SAME_BOXES for f in fractions.values())
    return {
        "min_iou": min_iou,
        **counts,
        **fractions,
        "score_abs_diff_mean": round(float(np.mean(diffs)), 5) if diffs else None,
        "same_boxes": same,
    }


def detections_of(model: torch.nn.Module, batches: Sequence[torch.Tensor]) -> list[dict[str, np.ndarray]]:
    return [d for batch in batches for d in numpy_detections(run_batch(model, batch))]


def reference_boxes(
    model: torch.nn.Module, batches: Sequence[torch.Tensor], precision: str
) -> tuple[float, list[dict[str, np.ndarray]]]:
    """The model's boxes at ``precision`` at the first of :data:`COMPILE_SCORE_THRESHOLDS` where it finds a box a
    tile (a briefly trained model's scores are low); the model keeps that threshold (its score filter)."""
    tiles = sum(len(batch) for batch in batches)
    with predicting(precision, batches[0].device):
        for threshold in COMPILE_SCORE_THRESHOLDS:
            model.score_thresh = threshold
            reference = detections_of(model, batches)
            if sum(len(d["boxes"]) for d in reference) >= tiles:
                break
    return threshold, reference


def compared_boxes(
    eager: torch.nn.Module, compiled: torch.nn.Module, batches: Sequence[torch.Tensor], precision: str
) -> tuple[float, dict[str, list[dict[str, np.ndarray]]]]:
    """Both models' boxes at ``precision``, at the eager one's threshold of :func:`reference_boxes` (the
    threshold is the model's score filter: the compiled graphs are the same at any)."""
    threshold, reference = reference_boxes(eager, batches, precision)
    compiled.score_thresh = threshold
    with predicting(precision, batches[0].device):
        return threshold, {"eager": reference, "compiled": detections_of(compiled, batches)}


def compile_comparison(
    model_file: Path,
    raster: Path,
    manifest: Path,
    sizes: Sizes,
    device_name: str,
    precision: str,
    threads: int,
    mode: str | None = None,
) -> dict[str, Any]:
    """Eager path against the compiled one (``mode``) at ``precision`` on the same tiles: rates (alternating
    rounds), boxes, verdict."""
    device = torch.device(device_name)
    torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = True
    images = device_tiles(raster, manifest, sizes.compile_tiles, device)
    batches = full_batches(images, sizes.predict_batch)
    eager = detector(model_file, device, COMPILE_SCORE_THRESHOLDS[0])
    compiled = compile_detector(detector(model_file, device, COMPILE_SCORE_THRESHOLDS[0]), sizes.compile_backend, mode)
    with predicting(precision, device):
        started = time.perf_counter()
        run_batch(compiled, batches[0])
        synchronize(device)
        compile_s = time.perf_counter() - started
        run_batch(eager, batches[0])
        seconds: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(sizes.rounds):
            seconds["eager"].append(timed_pass(eager, batches, device))
            seconds["compiled"].append(timed_pass(compiled, batches, device))
    threshold, boxes = compared_boxes(eager, compiled, batches, precision)
    tiles = len(batches) * sizes.predict_batch
    rates = {name: round(tiles / statistics.median(values), 2) for name, values in seconds.items()}
    speedup = ratio(rates["compiled"], rates["eager"]) or 0.0
    agreement = box_agreement(boxes["eager"], boxes["compiled"])
    return {
        "backend": sizes.compile_backend,
        "mode": mode or "default",
        "precision": precision,
        "device": device_name,
        "tiles": tiles,
        "batch": sizes.predict_batch,
        "score_threshold": threshold,
        "compile_s": round(compile_s, 1),
        "tiles_per_s": rates,
        "speedup": speedup,
        "agreement": agreement,
        "kept": bool(speedup >= KEEP_SPEEDUP and agreement["same_boxes"]),
        "rule": f"kept if compiled/eager >= {KEEP_SPEEDUP} and >= {SAME_BOXES:.0%} of boxes matched each way",
    }


def _child(conn: Any, function: Callable[..., dict[str, Any]], args: tuple) -> None:
    conn.send(attempt(functools.partial(function, *args)))
    conn.close()


def isolated(function: Callable[..., dict[str, Any]], args: tuple, timeout: float) -> dict[str, Any]:
    """``function(*args)`` in a fresh (spawned) process, given ``timeout`` seconds: a hang or a crash there is
    this measurement's error, not the run's end."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, function, args), daemon=True)
    process.start()
    send.close()
    try:
        if not receive.poll(timeout):
            raise TimeoutError(f"no result within {timeout:.0f} s")
        return receive.recv()
    except EOFError:
        process.join(10)
        raise RuntimeError(f"the measuring process died (exit code {process.exitcode})") from None
    finally:
        if process.is_alive():
            process.terminate()
            process.join(10)
        if process.is_alive():
            process.kill()


def compile_comparisons(
    model_file: Path,
    raster: Path,
    manifest: Path,
    sizes: Sizes,
    device_name: str,
    at: tuple[str, ...],
    threads: int,
    mode: str | None,
) -> dict[str, Any]:
    """:func:`compile_comparison` of one mode at each precision of ``at``, one after the other in this process,
    each failing soft."""
    args = (model_file, raster, manifest, sizes, device_name)
    return {
        precision: attempt(functools.partial(compile_comparison, *args, precision, threads, mode)) for precision in at
    }


def measure_compile(bench: Bench) -> dict[str, Any]:
    """Each compile mode at ``auto`` and at ``32-true`` (one precision where they are the same), each against
    eager at its precision, a mode in a process of its own (a compiler that hangs costs that mode's rows); a mode
    is kept where it is kept at every precision."""
    raster, manifest = bench.predict_scene
    s = bench.sizes
    at = tuple(dict.fromkeys((bench.auto, precisions.FP32)))
    runs: dict[str, dict[str, Any]] = {}
    for mode in s.compile_modes:
        args = (bench.model_file, raster, manifest, s, str(bench.device), at, bench.threads, mode)
        result = attempt(functools.partial(isolated, compile_comparisons, args, s.compile_timeout_s * len(at)))
        for precision in at:
            runs[f"{mode or 'default'} @ {precision}"] = result if "error" in result else result[precision]
    kept = [
        mode or "default"
        for mode in s.compile_modes
        if all(run.get("kept") for name, run in runs.items() if name.startswith(f"{mode or 'default'} @ "))
    ]
    return {"runs": runs, "kept_modes": kept, "model": f"{describe_model(s)}, {bench.model_kind}"}


# --- instances ------------------------------------------------------------------------------------------------


def measure_instances(bench: Bench) -> dict[str, Any]:
    """Mask R-CNN's prediction job at ``auto`` on every rank against its pure forward at the job's batch (the
    same tiles' kind, preloaded on the device, run as the job runs them)."""
    s, device = bench.sizes, bench.device
    raster, manifest = bench.predict_scene
    model_file = write_instance_model(bench.workdir / "instances.pt", s.backbone, s.patch, resize=s.resize)
    predict = job_predict(bench, precisions.AUTO, bench.ranks)
    tiling = {"patch_size": s.patch, "overlap": s.overlap}
    config = validate_config({"task": "instances", "tiling": tiling, "predict": predict})
    config = {key: config[key] for key in ("task", "model", "tiling", "predict")}
    workdir = bench.workdir / "instances"
    job = run_predict_job(workdir, raster, manifest, model_file, predict, timeout=s.job_timeout_s, config=config)
    summary = job_summary(job)
    torch.set_num_threads(bench.threads)
    task = InstancesTask()
    settings = job_settings(config)
    model = task.prepare_for_inference(task.load_model(model_file, settings)[0], settings.predict).to(device)
    images = device_tiles(raster, manifest, s.forward_tiles, device)
    forward = forward_rate(model, images, s.predict_batch, bench.auto, s.rounds, task)
    per_rank = [rank["tiles_per_s"] for rank in summary["ranks"] if rank["tiles"]]
    del model, images
    release(device)
    return {
        **summary,
        "precision": bench.auto,
        "batch": s.predict_batch,
        "forward_tiles_per_s": round(forward, 2),
        "job_over_forward": ratio(statistics.mean(per_rank), forward) if per_rank else None,
        "model": f"Mask R-CNN-{s.backbone}, {s.patch} px tiles"
        + (f" seen at {s.resize[0]} px" if s.resize else "")
        + ", untrained (every tile at its cap of instances)",
    }


# --- copy -----------------------------------------------------------------------------------------------------


def copy_rate(device: torch.device, shape: tuple[int, ...], pinned: bool, rounds: int) -> float:
    """GB/s of copies of a uint8 host batch into a device tensor: pinned ones non-blocking, as a GPU job copies."""
    host = torch.randint(0, 256, shape, dtype=torch.uint8)
    if pinned:
        host = host.pin_memory()
    target = torch.empty(shape, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=pinned)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(rounds):
        target.copy_(host, non_blocking=pinned)
    synchronize(device)
    return host.numel() * rounds / (time.perf_counter() - started) / 1e9


def measure_copy(bench: Bench) -> dict[str, Any]:
    """Copy rates of a prediction batch of uint8 tiles, pinned and pageable, and the auto job's data wait."""
    s, device = bench.sizes, bench.device
    shape = (s.predict_batch, 3, s.patch, s.patch)
    nbytes = int(np.prod(shape))
    rates: dict[str, float | None] = {"pageable": copy_rate(device, shape, False, s.copy_rounds)}
    rates["pinned"] = copy_rate(device, shape, True, s.copy_rounds) if device.type == "cuda" else None
    job = bench.predicted
    return {
        "device": str(device),
        "batch_shape": list(shape),
        "batch_mb": round(nbytes / MB, 2),
        "gb_per_s": {k: round(v, 3) if v is not None else None for k, v in rates.items()},
        "ms_per_batch": {k: round(1000 * nbytes / 1e9 / v, 3) if v else None for k, v in rates.items()},
        "pinned_note": None if device.type == "cuda" else "pinned memory needs CUDA: host to host copy only",
        "job_pins": bench.accelerator == "gpu",  # the prediction job pins (and copies non-blocking) on GPUs
        "job_wait_fraction": job["wait_fraction"] if job else None,
        "job_rank_wait_fraction": [rank["wait_fraction"] for rank in job["ranks"]] if job else None,
    }


# --- the run --------------------------------------------------------------------------------------------------


def measure_dense(bench: Bench) -> dict[str, Any]:
    """The dense tasks' host path on the rank's device (bench/host_ceiling.py): the null model's job (one rank, its
    own worker count) for segmentation and regression, and the U-Net segmenter's job against its pure forward at
    256 px, batch ``unet_batch``; each with its stage timeline."""
    s = bench.sizes
    ceiling = measure_host_ceiling(bench.workdir / "ceiling", s.ceiling_side, (None,), bench.accelerator)
    unet = attempt(
        functools.partial(measure_unet_job, bench.workdir / "unet", s.unet_side, s.unet_batch, bench.accelerator)
    )
    return {"ceiling": ceiling, "unet": unet}


# in this order: predict and forward take train's model, copy predict's data wait; compile, the longest (four
# compilations, each in a process of its own), last, so that a run cut short (a lent GPU's call limit) keeps the
# issues' target rows, each section's JSON written as it ends
SECTIONS: tuple[tuple[str, Callable[[Bench], dict[str, Any]]], ...] = (
    ("dense", measure_dense),
    ("train", measure_train),
    ("predict", measure_predict),
    ("forward", measure_forward),
    ("instances", measure_instances),
    ("copy", measure_copy),
    ("compile", measure_compile),
)


def nvml_devices() -> dict[str, Any]:
    """The GPUs as NVML sees them (name, memory, driver), or why it cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # no library, no driver: no NVML figures, and that is all
        return {"error": brief(err)}
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(k) for k in range(pynvml.nvmlDeviceGetCount())]
        devices = []
        for index, handle in enumerate(handles):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory_total_mb": round(memory.total / MB),
                    "memory_used_mb": round(memory.used / MB),
                }
            )
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {"driver": driver.decode() if isinstance(driver, bytes) else str(driver), "devices": devices}
    except Exception as err:
        return {"error": brief(err)}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def chosen_sections(names: Sequence[str] | None) -> list[str]:
    """The sections ``names`` names (None: every one), in the bench's order, each checked to be a section."""
    every = [name for name, _ in SECTIONS]
    unknown = sorted(set(names or ()) - set(every))
    if unknown:
        raise ValueError(f"no bench-gpu section {', '.join(unknown)}: the sections are {', '.join(every)}")
    return [name for name in every if names is None or name in names]


def run_sections(
    bench: Bench, done: Callable[[str, dict[str, Any]], None] | None = None, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Every section (or those ``names`` names) in order, each failing soft; ``done(name, result)`` after each (to
    save what is measured). A section whose model a skipped ``train`` would have trained predicts with the untrained
    one (:attr:`Bench.model_file`)."""
    chosen = chosen_sections(names)
    results: dict[str, Any] = {}
    for name, measure in SECTIONS:
        if name not in chosen:
            continue
        results[name] = attempt(functools.partial(measure, bench))
        if done is not None:
            done(name, results[name])
    return results
