"""The prediction rank's profiler: a Lightning callback measuring time, memory and utilization batch by batch,
in all and per scene of the job (:mod:`rasterscale.predict.profile` says what each figure means). A batch ends when the
rank's outputs have taken its results: the rank writer calls :meth:`PredictProfiler.end_batch` with the time
that took."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch

from rasterscale.grid.sharding import rank_file_index
from rasterscale.jobs.profile import RankProfile
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


@dataclass
class Share:
    """What a rank spent on one scene (or on all): tiles, batches, and the wall, compute and output time of its
    batches, a batch's time split between its scenes by their tiles (so that the scenes' walls add up to the
    rank's)."""

    tiles: int = 0
    batches: int = 0
    wall_s: float = 0.0
    compute_s: float = 0.0
    output_s: float = 0.0
    memory: list[int] = field(default_factory=list)

    def add(self, tiles: int, fraction: float, wall: float, compute: float, output: float, memory: int) -> None:
        self.tiles += tiles
        self.batches += 1
        self.wall_s += wall * fraction
        self.compute_s += compute * fraction
        self.output_s += output * fraction
        self.memory.append(memory)


class PredictProfiler(L.Callback):
    """Measures one rank's prediction batch by batch (:mod:`rasterscale.predict.profile` says what and how), in all
    and per scene; :meth:`finish` returns the rank's :class:`RankProfile` (of one scene, or of the job)."""

    def __init__(self, strategy: str, batch_size: int, workers: int, shard: int = 0) -> None:
        self.strategy, self.batch_size, self.workers, self.shard = strategy, batch_size, workers, shard
        self.device = torch.device("cpu")
        self.started = self.mark = self.batch_started = time.perf_counter()
        self.cpu_started = self.cpu_mark = time.process_time()
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

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.on_gpu:
            self.sampler = UtilizationSampler(self.device).start()

    def on_predict_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.batch_started = time.perf_counter()

    def end_batch(self, keys: list, output: float) -> None:
        """A batch of tiles (``keys``: their scene index first) is done, its results taken by the rank's outputs
        in the last ``output`` seconds (blending, writing): the batch's compute is the rest since it started."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            memory = torch.cuda.max_memory_allocated(self.device)
        else:
            memory = rss_now()
        now = time.perf_counter()
        wall, compute = now - self.mark, now - self.batch_started - output
        self.mark, self.cpu_mark = now, time.process_time()
        self.total.add(len(keys), 1.0, wall, compute, output, memory)
        counts = np.bincount([int(key[0]) for key in keys])
        for scene in np.flatnonzero(counts):
            share = self.scenes.setdefault(int(scene), Share())
            share.add(int(counts[scene]), counts[scene] / len(keys), wall, compute, output, memory)
        if now - self.workers_sampled >= WORKER_SAMPLE_PERIOD_S:
            self.workers_peak, self.workers_sampled = max(self.workers_peak, workers_rss()), now

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
        )
