"""The cost estimate printed before anything is queued: the main Snakemake process prints it once per invocation
(``snakemake -n`` and every run: rules/common.smk), one line per section, e.g.::

    plan: predict: 200,000 scenes and 399,100 seams, at most 41.3M tiles (400 px, overlap 80): ≈ 81,304 GPU-hours
    at 141 tiles/s (400 px) per NVIDIA H200 (from make bench-gpu on gpu01, 2026-11-26) or ≈ 4,337,429 CPU
    core-hours at 2.65 tiles/s (400 px) per core of AMD EPYC (from make bench on login1, 2026-11-24)

- **Tiles** come from the plan alone, no manifest read: each predicted scene's raster size (its footprint) laid out
  by the tile manifests' own grid (:func:`rasterscale.grid.manifest.tile_count`), and each seam's tiles near its
  core (:func:`rasterscale.grid.manifest.seam_tile_counts`). "At most": a manifest leaves out tiles wholly masked,
  and a seam between overlapping scenes may have fewer. A demo scene not made yet counts by its demo keys' size.
- **Rates** come from the last bench of this machine or cluster, else a documented default
  (:mod:`rasterscale.workflow.throughput`); the line names which. Hours are tiles / (tiles/s of one GPU, or of one CPU
  core) / 3600, as printed; the bench's tile size is given beside its rate (another model or tile size takes
  another time).
- **Training** (where the run trains): at most ``max_steps`` × the effective batch images; without ``max_steps``
  the steps are known only once the training tiles are.
- **Slurm** (``slurm.launcher: srun``, as profiles/slurm sets: a launcher whose jobs are priced as a cluster's,
  :mod:`rasterscale.runtime.launchers`): the jobs, nodes and wall time its DDP jobs ask for, and how long the
  largest prediction job would take at the GPU rate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rasterscale.grid.manifest import seam_tile_counts, tile_count
from rasterscale.jobs import paths
from rasterscale.runtime import batching
from rasterscale.runtime.launchers import launcher_of
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.throughput import CPU, GPU, Throughput, first_throughputs, predicting, training

PREFIX = "plan: "  # of every line (rules/common.smk adds "rasterscale: ")


@dataclass(frozen=True)
class Work:
    """What the plan predicts: at most each scene's and seam's tiles, and the predicted scenes not counted."""

    tiles: dict[str, int]  # scene or seam -> at most its tiles
    scenes: int  # predicted scenes
    seams: int
    uncounted: int  # predicted scenes of unknown size (no footprint, not a demo scene)

    @property
    def total(self) -> int:
        return sum(self.tiles.values())


def prediction_work(plan: Plan) -> Work:
    """The tiles of every predicted scene and seam, from the plan's footprints (no manifest is read)."""
    tiling = plan.settings.tiling
    sizes = {name: raster_size(plan, name) for name in plan.predict_scenes}
    tiles = {
        name: _scene_tiles(*size, tiling.patch_size, tiling.overlap) for name, size in sizes.items() if size is not None
    }
    counts = seam_tile_counts(plan.seams, plan.footprints, tiling.patch_size, tiling.overlap)
    tiles.update(zip((seam.name for seam in plan.seams), counts, strict=True))
    return Work(tiles, len(sizes), len(plan.seams), len([size for size in sizes.values() if size is None]))


def raster_size(plan: Plan, name: str) -> tuple[int, int] | None:
    """A predicted scene's width and height: its footprint's, a demo scene's not made yet from its demo keys; None
    where neither is known."""
    if name in plan.footprints:
        return plan.footprints[name].raster_size()
    demo = plan.settings.demo.scenes.get(name)
    return (demo.width, demo.height) if demo is not None else None


@functools.lru_cache(maxsize=4096)
def _scene_tiles(width: int, height: int, patch_size: int, overlap: int) -> int:
    """:func:`tile_count`, once per raster size (the scenes of a survey share a few)."""
    return tile_count(width, height, patch_size, overlap)


def hours(work: float, rate: float) -> float:
    """Hours of one device (a GPU, a CPU core) for ``work`` tiles or images at ``rate`` a second."""
    return work / rate / 3600


def figure(value: float) -> str:
    """A figure of the lines: whole and grouped from 100 (1,300), else three significant digits (2.65, 0.000412)."""
    if value >= 100:
        return f"{round(value):,}"
    return np.format_float_positional(value, precision=3, unique=False, fractional=False, trim="-")


def count(value: int) -> str:
    """A count: grouped (200,000), in millions from a million (41.3M)."""
    return f"{value:,}" if value < 1_000_000 else f"{value / 1e6:,.1f}M"


def plural(value: int, word: str, words: str = "") -> str:
    """A count and its noun: ``1 scene``, ``2 scenes``, ``2 batches`` (``words``: the plural, when not word + s)."""
    return f"{count(value)} {word if value == 1 else words or word + 's'}"


def device_hours(work: int, rate: float, what: str, entry: Throughput) -> str:
    """One alternative: the hours of ``work`` on ``entry``'s device at ``rate`` (of ``what``: tiles, images) a
    second, its rate and where it comes from."""
    unit = "GPU-hours" if entry.kind == GPU else "CPU core-hours"
    return (
        f"≈ {figure(hours(work, rate))} {unit} at {figure(rate)} {what}/s ({entry.patch_size} px) per {entry.unit}"
        f" ({entry.provenance()})"
    )


def predict_line(plan: Plan, work: Work, entries: Mapping[str, Throughput]) -> str:
    """The prediction's line: scenes, seams, tiles, and their hours on a GPU or on CPU cores."""
    tiling = plan.settings.tiling
    members = plural(work.scenes, "scene") + (f" and {plural(work.seams, 'seam')}" if work.seams else "")
    if work.uncounted:
        members += f" ({count(work.uncounted)} of unknown size not counted)"
    chosen = [predicting(entries, kind) for kind in (GPU, CPU)]
    alternatives = " or ".join(device_hours(work.total, entry.per_device, "tiles", entry) for entry in chosen)
    tiles = f"at most {count(work.total)} tiles ({tiling.patch_size} px, overlap {tiling.overlap})"
    return f"{PREFIX}predict: {members}, {tiles}: {alternatives}"


def effective_batch(plan: Plan) -> int:
    """Images one optimizer step sees across all ranks (:mod:`rasterscale.runtime.batching`)."""
    return batching.effective_batch(plan.settings.train.batch_size, plan.world_size("train"))


def train_images(plan: Plan) -> int | None:
    """At most the images training sees (``max_steps`` × the effective batch); None without ``max_steps``."""
    steps = plan.settings.train.max_steps
    return steps * effective_batch(plan) if steps > 0 else None


def train_line(plan: Plan, entries: Mapping[str, Throughput]) -> str:
    """The training's line: steps × effective batch, and their hours on a GPU or on CPU cores where a bench has a
    training rate."""
    train, batch = plan.settings.train, effective_batch(plan)
    images = train_images(plan)
    if images is None:
        return (
            f"{PREFIX}train: {train.epochs} epochs of the training tiles, {batch} images a step (effective batch): "
            "time unknown until their tile manifests are made (set train.max_steps to bound it)"
        )
    alternatives = []
    for kind in (GPU, CPU):
        entry = training(entries, kind)
        rate = entry.train_per_device if entry is not None else None
        if entry is None or rate is None:
            alternatives.append(f"on {kind.upper()}s unknown (no bench has measured training there)")
        else:
            alternatives.append(device_hours(images, rate, "images", entry))
    steps = f"at most {train.max_steps:,} steps x {batch} images (effective batch) = {count(images)} images"
    return f"{PREFIX}train: {steps}: {' or '.join(alternatives)}"


def batch_tiles(plan: Plan, work: Work) -> list[int]:
    """At most each prediction batch's tiles."""
    return [sum(work.tiles.get(name, 0) for name in names) for names in plan.members.values()]


def asks_gpus(plan: Plan, section: str) -> bool:
    """Whether a section's jobs ask their executor for GPUs (their launcher's
    :meth:`~rasterscale.runtime.launchers.Launcher.asks_gpus`)."""
    return launcher_of(plan.settings.slurm).asks_gpus(plan.section(section), plan.settings.slurm)


def job_shape(plan: Plan, section: str) -> str:
    """What one job of a section asks for: its nodes, and the GPUs (or CPU ranks) on each."""
    geometry = plan.geometry[section]
    what = ("GPU", "GPUs") if asks_gpus(plan, section) else ("CPU rank", "CPU ranks")
    return f"{plural(geometry.nodes, 'node')} x {plural(geometry.devices, *what)}"


def wall_time(plan: Plan, section: str, jobs: int) -> str:
    """A section's jobs' wall time (its slurm runtime key) and at most the node-hours they ask for."""
    minutes = plan.settings.slurm.runtime(section)
    key = f"slurm.{section}_runtime"
    if not minutes:
        return f"the profile's default runtime each ({key}: 0)"
    node_hours = figure(jobs * plan.geometry[section].nodes * minutes / 60)
    return f"{minutes:,} min each ({key}): at most {node_hours} node-hour{'' if node_hours == '1' else 's'}"


def overrun(plan: Plan, section: str, minutes: float, keys: str) -> str:
    """A warning where a section's estimated job time passes its Slurm wall time (none where it fits or is unset)."""
    limit = plan.settings.slurm.runtime(section)
    if not limit or minutes <= limit:
        return ""
    return f", more than its {limit:,} min: raise slurm.{section}_runtime or {keys}"


def slurm_predict_line(plan: Plan, work: Work, entries: Mapping[str, Throughput]) -> str:
    """The prediction jobs the Slurm profile asks for (batches × shards), and the largest one's time on GPUs."""
    shards, batches = plan.shards, len(plan.members)
    jobs = batches * shards
    split = f"{plural(batches, 'batch', 'batches')} x {plural(shards, 'shard')}"
    line = (
        f"{PREFIX}slurm: predict: {plural(jobs, 'job')} ({split}) of {job_shape(plan, 'predict')},"
        f" {wall_time(plan, 'predict', jobs)}"
    )
    largest = max(batch_tiles(plan, work), default=0)
    if asks_gpus(plan, "predict") and largest:
        entry = predicting(entries, GPU)
        minutes = largest / shards / (plan.geometry["predict"].devices * entry.per_device) / 60
        line += f"; the largest ≈ {figure(minutes)} min at {figure(entry.per_device)} tiles/s per GPU"
        line += overrun(plan, "predict", minutes, "predict.shards")
    return line


def slurm_train_line(plan: Plan, entries: Mapping[str, Throughput]) -> str:
    """The training job the Slurm profile asks for, and its time on GPUs where that is known."""
    line = f"{PREFIX}slurm: train: 1 job of {job_shape(plan, 'train')}, {wall_time(plan, 'train', 1)}"
    images, entry = train_images(plan), training(entries, GPU)
    rate = entry.train_per_device if entry is not None else None
    if asks_gpus(plan, "train") and images and rate:
        minutes = images / (plan.world_size("train") * rate) / 60
        line += f"; ≈ {figure(minutes)} min at {figure(rate)} images/s per GPU"
        line += overrun(plan, "train", minutes, "train.devices or train.nodes")
    return line


def estimate_lines(plan: Plan, entries: Mapping[str, Throughput]) -> list[str]:
    """The estimate's lines: prediction, training, and with ``slurm.launcher: srun`` their Slurm jobs (none for a
    section the run does not have)."""
    lines, slurm = [], launcher_of(plan.settings.slurm).prices_cluster_jobs
    work = prediction_work(plan) if plan.predict_scenes else None
    if work is not None:
        lines.append(predict_line(plan, work, entries))
    if plan.trains:
        lines.append(train_line(plan, entries))
    if slurm and work is not None and plan.members:
        lines.append(slurm_predict_line(plan, work, entries))
    if slurm and plan.trains:
        lines.append(slurm_train_line(plan, entries))
    return lines


def throughput_files(workdir: str | Path = ".", checkout: str | Path | None = None) -> list[Path]:
    """Where the bench results are looked for, in order: the working directory's, the workflow checkout's (where
    make bench writes them)."""
    folders = [Path(workdir), *([Path(checkout)] if checkout is not None else [])]
    return [folder / paths.throughput_file() for folder in folders]


def print_estimate(
    plan: Plan, out: Callable[[str], None], checkout: str | Path | None = None, workdir: str | Path = "."
) -> None:
    """Print the estimate's lines through ``out``, with the bench results of :func:`throughput_files`."""
    entries, note = first_throughputs(throughput_files(workdir, checkout))
    if note:
        out(f"{PREFIX}{note}")
    for line in estimate_lines(plan, entries):
        out(line)
