"""The prediction rank's profiler: a Lightning callback measuring time, memory and utilization batch by batch,
in all and per scene of the job (:mod:`rasterscale.predict.profile` says what each figure means), and the rank's
stage timeline (:class:`StageClock`). A batch ends when the rank's outputs have taken its results: the rank writer
calls :meth:`PredictProfiler.end_batch`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch

from rasterscale.grid.sharding import rank_file_index
from rasterscale.jobs.profile import STAGES, RankProfile
from rasterscale.predict.profile import (
    MB,
    WORKER_SAMPLE_PERIOD_S,
    UtilizationSampler,
    host_memory_total,
    host_name,
    peak_rss,
    rss_now,
    workers_rss,
)

COMPUTE_STAGES = ("h2d", "forward", "post")  # the profile's compute_s
OUTPUT_STAGES = ("d2h", "blend", "write")  # the profile's output_s (its wait_s: the wait)
DEVICE_STAGES = COMPUTE_STAGES  # timed on a GPU by its own events too (the host only queues them)
EVENTS_HELD = 64  # CUDA events of the timeline held before the older half is added up


class StageClock:
    """The rank's main thread's time, stage by stage (:data:`STAGES`): each :meth:`lap` gives the time since the
    previous one to a stage, so that the stages add up to the rank's wall from :meth:`start` to the last lap.

    ``wait``: the rank waiting for its next batch of tiles (the dataloader; its workers read in parallel);
    ``h2d``: the batch's copy to the device and its scaling there; ``forward``: the model; ``post``: the task's
    post-processing (softmax, mask thresholds); ``d2h``: results copied to the host while the rank waits;
    ``blend``: the rank outputs taking the batch (blending, gathering objects); ``write``: the rank waiting for
    its writer thread, saving parts, and after the last batch the outputs' final writes (the loop's end with them).
    On a GPU the host only queues device work: CUDA events time ``h2d``,
    ``forward`` and ``post`` on the device too (:meth:`device_seconds`)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.mark = time.perf_counter()
        self.events: list[tuple[str, Any]] = []  # (stage, CUDA event at its lap's end), not yet added up
        self.device_totals = {f"device_{stage}": 0.0 for stage in DEVICE_STAGES}

    def start(self, device: torch.device) -> None:
        self.device, self.mark = device, time.perf_counter()
        self.seconds = dict.fromkeys(STAGES, 0.0)

    def lap(self, stage: str) -> float:
        """The time since the previous lap, given to ``stage``; returned."""
        now = time.perf_counter()
        spent, self.mark = now - self.mark, now
        self.seconds[stage] += spent
        if self.device.type == "cuda" and stage in (*DEVICE_STAGES, "wait"):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append((stage, event))
            if len(self.events) >= EVENTS_HELD:
                self._add_device_time(len(self.events) - EVENTS_HELD // 2)
        return spent

    def move(self, seconds: float, source: str, target: str) -> None:
        """Seconds of a lap that belonged to another stage (a copy or a wait inside the blend)."""
        seconds = min(seconds, self.seconds[source])
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def _add_device_time(self, upto: int) -> None:
        """Add the device's time between the events up to ``upto`` (waiting for it to get there: a few batches
        behind the host) to the totals; the later ones are kept."""
        self.events[upto][1].synchronize()
        for (_, start), (stage, end) in itertools.pairwise(self.events[: upto + 1]):
            if stage in DEVICE_STAGES:
                self.device_totals[f"device_{stage}"] += start.elapsed_time(end) / 1000.0
        self.events = self.events[upto:]

    def device_seconds(self) -> dict[str, float]:
        """On a GPU, the device's time per stage between the events (waits for the device to finish first)."""
        if self.device.type != "cuda":
            return {}
        if self.events:
            self._add_device_time(len(self.events) - 1)
        return dict(self.device_totals)


@dataclass
class Share:
    """What a rank spent on one scene (or on all): tiles, batches, and the seconds of each stage of its batches, a
    batch's time split between its scenes by their tiles (so that the scenes' walls add up to the rank's); its
    wall, compute and output time are sums of stages."""

    tiles: int = 0
    batches: int = 0
    memory: list[int] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def add(self, tiles: int, fraction: float, stages: dict[str, float], memory: int) -> None:
        """A batch's tiles of the scene, the ``fraction`` of the batch they are, the batch's stage seconds."""
        self.tiles += tiles
        self.batches += 1
        self.memory.append(memory)
        self.add_time(fraction, stages)

    def add_time(self, fraction: float, stages: dict[str, float]) -> None:
        """A ``fraction`` of stage seconds (a batch's, or the final write's)."""
        for stage, seconds in stages.items():
            self.stages[stage] += seconds * fraction

    @property
    def wall_s(self) -> float:
        return sum(self.stages.values())

    @property
    def compute_s(self) -> float:
        return sum(self.stages[stage] for stage in COMPUTE_STAGES)

    @property
    def output_s(self) -> float:
        return sum(self.stages[stage] for stage in OUTPUT_STAGES)


class PredictProfiler(L.Callback):
    """Measures one rank's prediction batch by batch (:mod:`rasterscale.predict.profile` says what and how), in all
    and per scene; :meth:`finish` returns the rank's :class:`RankProfile` (of one scene, or of the job)."""

    def __init__(self, strategy: str, batch_size: int, workers: int, shard: int = 0) -> None:
        self.strategy, self.batch_size, self.workers, self.shard = strategy, batch_size, workers, shard
        self.device = torch.device("cpu")
        self.started = self.mark = time.perf_counter()
        self.cpu_started = self.cpu_mark = time.process_time()
        self.clock = StageClock()
        self.counted = dict.fromkeys(STAGES, 0.0)  # the clock's stages at the end of the previous batch
        self.parallel: dict[str, float] = {"read": 0.0, "writer": 0.0}  # beside the rank's main thread
        self.total = Share()
        self.scenes: dict[int, Share] = {}
        self.workers_peak, self.workers_sampled = 0, 0.0
        self.sampler: UtilizationSampler | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The rank's clock starts before its data are set up (a region is read there)."""
        self.device = trainer.strategy.root_device
        self.started = self.mark = time.perf_counter()
        self.cpu_started = self.cpu_mark = time.process_time()
        self.clock.start(self.device)
        self.counted = dict.fromkeys(STAGES, 0.0)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.on_gpu:
            self.sampler = UtilizationSampler(self.device).start()

    def on_predict_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end_batch(self, keys: list, read_s: float) -> None:
        """A batch of tiles (``keys``: their scene index first, read in ``read_s`` seconds by the dataloader) is
        done, its results taken by the rank's outputs: its stages are the clock's laps since the previous batch."""
        memory = torch.cuda.max_memory_allocated(self.device) if self.on_gpu else rss_now()
        stages = self._laps_since_counted()
        self.parallel["read"] += read_s
        self.total.add(len(keys), 1.0, stages, memory)
        counts = np.bincount([int(key[0]) for key in keys])
        for scene in np.flatnonzero(counts):
            share = self.scenes.setdefault(int(scene), Share())
            share.add(int(counts[scene]), counts[scene] / len(keys), stages, memory)
        if self.mark - self.workers_sampled >= WORKER_SAMPLE_PERIOD_S:
            self.workers_peak, self.workers_sampled = max(self.workers_peak, workers_rss()), self.mark

    def end_write(self, scene: int) -> None:
        """A scene's rank output is written (after the last batch): the time since the previous lap is its
        ``write`` (the loop's end after the last batch, then the output's final write)."""
        if not self.total.batches:
            return  # a rank without tiles: no timeline (Lightning ran no batch)
        self.clock.lap("write")
        stages = self._laps_since_counted()
        self.total.add_time(1.0, stages)
        self.scenes.setdefault(scene, Share()).add_time(1.0, stages)

    def _laps_since_counted(self) -> dict[str, float]:
        """Each stage's seconds since the previous batch or write; the rank's wall ends at the last lap."""
        stages = {stage: self.clock.seconds[stage] - self.counted[stage] for stage in STAGES}
        self.counted = dict(self.clock.seconds)
        self.mark, self.cpu_mark = self.clock.mark, time.process_time()
        return stages

    def add_parallel(self, stage: str, seconds: float) -> None:
        """Seconds of work beside the rank's main thread (a writer thread's)."""
        self.parallel[stage] = self.parallel.get(stage, 0.0) + seconds

    def finish(self, trainer: L.Trainer, scene: int | None = None) -> RankProfile:
        """The rank's profile of one scene of the job, or of all (also for a rank without tiles, where Lightning
        ran no batch). The utilization is the rank's over the job."""
        share = self.total if scene is None else self.scenes.get(scene, Share())
        rank_wall = self.mark - self.started if self.total.batches else 0.0
        wall = share.wall_s
        wait = wall - share.compute_s - share.output_s
        if self.on_gpu:
            threads = 1
            utilization = self.sampler.stop() if self.sampler is not None else None
            source = "nvml" if utilization is not None else "unavailable"
            total = torch.cuda.get_device_properties(self.device).total_memory
            device = f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        else:
            threads = torch.get_num_threads()
            utilization = (self.cpu_mark - self.cpu_started) / (rank_wall * threads) if rank_wall > 0 else None
            source, total, device = "cpu_time", host_memory_total(), "cpu"

        def rate(count: int) -> float:
            return round(count / wall, 4) if wall > 0 else 0.0

        world = trainer.world_size
        return RankProfile(
            rank=rank_file_index(self.shard, world, trainer.global_rank),
            shard=self.shard,
            world_size=world,
            host=host_name(),
            device=device,
            strategy=self.strategy,
            precision=str(trainer.precision),
            batch_size=self.batch_size,
            workers=self.workers,
            threads=threads,
            tiles=share.tiles,
            batches=share.batches,
            wall_s=round(wall, 4),
            compute_s=round(share.compute_s, 4),
            output_s=round(share.output_s, 4),
            wait_s=round(wait, 4),
            output_fraction=round(share.output_s / wall, 4) if wall > 0 else 0.0,
            wait_fraction=round(wait / wall, 4) if wall > 0 else 0.0,
            batches_per_s=rate(share.batches),
            tiles_per_s=rate(share.tiles),
            memory_kind="cuda_allocated" if self.on_gpu else "host_rss",
            memory_peak_mb=round(max(share.memory, default=0) / MB, 1),
            memory_mean_mb=round(sum(share.memory) / len(share.memory) / MB, 1) if share.memory else 0.0,
            memory_total_mb=round(total / MB, 1),
            utilization=round(utilization, 4) if utilization is not None else None,
            utilization_source=source,
            host_rss_peak_mb=round(peak_rss() / MB, 1),
            workers_rss_peak_mb=round(max(self.workers_peak, workers_rss()) / MB, 1),
            stages={stage: round(seconds, 4) for stage, seconds in share.stages.items()},
            parallel={
                stage: round(seconds, 4) for stage, seconds in {**self.parallel, **self.clock.device_seconds()}.items()
            },
        )
