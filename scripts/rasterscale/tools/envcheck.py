"""The environment check: DDP prediction of the task's untrained model over random tiles, no raster needed. It
checks ranks, devices and throughput (like the seeds' mgpr with fake data): rule check_environment."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset

from rasterscale.atomic import write_json
from rasterscale.datasets.tiles import DummyDataset
from rasterscale.grid.sharding import split_balanced
from rasterscale.predict.batches import Batches
from rasterscale.predict.engine import BatchEndCallback, PredictionDataModule, PredictionModule
from rasterscale.predict.measure import StageClock
from rasterscale.runtime.cores import rank_workers
from rasterscale.runtime.ranks import RankLayout, end_rank, make_trainer, start_rank
from rasterscale.settings import Settings
from rasterscale.tasks.registry import task_spec

LOGGER_NAME = "rasterscale.check"


class RankShare(Dataset):
    """A rank's share of the random tiles: item -> (image, (0, position), 0.0), as prediction's datasets key them
    (:class:`~rasterscale.predict.batches.ScenesDataset`: no read time), in batches of one shape."""

    def __init__(self, dataset: DummyDataset, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, tuple[int, int], float]:
        image, _ = self.dataset[self.indices[position]]
        return image, (0, position), 0.0

    def batches(self, batch_size: int) -> Batches:
        return Batches([list(range(k, min(k + batch_size, len(self)))) for k in range(0, len(self), batch_size)])


class ThroughputReport(BatchEndCallback):
    """Counts a rank's tiles and writes its throughput."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir, self.tiles, self.started = Path(out_dir), 0, time.perf_counter()

    def batch_predicted(self, trainer: L.Trainer, outputs: Any, batch: Any) -> None:
        self.tiles += len(batch[0])

    def write(self, trainer: L.Trainer) -> None:
        seconds = time.perf_counter() - self.started
        report = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "device": str(trainer.strategy.root_device),
            "tiles": self.tiles,
            "seconds": round(seconds, 3),
            "tiles_per_s": round(self.tiles / max(seconds, 1e-9), 3),
        }
        write_json(report, self.out_dir / f"rank-{trainer.global_rank}.json")
        logging.getLogger(LOGGER_NAME).info("environment check: %s", report)


def run_environment_check(settings: Settings, layout: RankLayout, out_dir: str | Path, log_dir: str | Path) -> None:
    """Every rank predicts its share of ``dummy.count`` random tiles with the task's untrained model."""
    start_rank(layout, log_dir, LOGGER_NAME)
    dummy, predict = settings.dummy, settings.predict
    task = task_spec(settings.task).load()
    model = task.prepare_for_inference(task.build_model(task.model_config(settings)), predict)
    dataset = DummyDataset(dummy.count, dummy.size, dummy.delay)
    indices = list(range(len(dataset)))

    def dataset_for_rank(world: int, rank: int, device: torch.device) -> RankShare:
        return RankShare(dataset, split_balanced(indices, world, rank))

    report = ThroughputReport(out_dir)
    trainer = make_trainer(layout, logger=False, callbacks=[report], use_distributed_sampler=False)
    clock = StageClock()
    datamodule = PredictionDataModule(
        dataset_for_rank,
        predict.batch_size,
        rank_workers(predict.workers, layout.accelerator, layout.devices),
        pin_memory=layout.accelerator == "gpu",
        clock=clock,
    )
    trainer.predict(PredictionModule(task, model, clock), datamodule=datamodule, return_predictions=False)
    report.write(trainer)
    end_rank()
