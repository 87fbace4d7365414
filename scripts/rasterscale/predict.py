"""DDP prediction over a tile manifest: every rank reads only its own tiles and writes its own file.

The manifest is split into ``shards`` balanced, contiguous parts (one job, one node each), and each shard into
``world_size`` parts, one per rank. Rank ``r`` of shard ``s`` writes ``rank-{s * world_size + r}.parquet``:
its detections already in the raster's CRS, plus the tile_ids it processed. Nothing crosses ranks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import geopandas as gpd
import lightning as L
import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from rasterscale.data import WindowDataset, collate_lists
from rasterscale.geo import pixel_boxes_to_polygons
from rasterscale.inputs import check_raster
from rasterscale.merge import empty_detections, write_rank_file
from rasterscale.model import load_checkpoint
from rasterscale.runtime import (
    RunSpec,
    cpu_threads_per_rank,
    current_rank,
    make_trainer,
    quiet_non_zero_ranks,
    setup_rank_logging,
)
from rasterscale.tiling import Tile, read_manifest, tiles_from_frame

LOGGER_NAME = "rasterscale.predict"


def split_balanced(items: list[Any], parts: int, index: int) -> list[Any]:
    """Part ``index`` of ``parts`` contiguous parts whose sizes differ by at most one."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of range for {parts} parts")
    base, extra = divmod(len(items), parts)
    start = index * base + min(index, extra)
    return items[start : start + base + (1 if index < extra else 0)]


def rank_tiles(tiles: list[Tile], shards: int, shard: int, world_size: int, rank: int) -> list[Tile]:
    return split_balanced(split_balanced(tiles, shards, shard), world_size, rank)


def rank_file_index(shard: int, world_size: int, rank: int) -> int:
    return shard * world_size + rank


@dataclass
class TileDetections:
    tile_id: int
    col_off: int
    row_off: int
    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray


class DetectorPredictionModule(L.LightningModule):
    def __init__(self, model: torch.nn.Module, tile_offsets: dict[int, tuple[int, int]]) -> None:
        super().__init__()
        # a rank may get no tile (more ranks than tiles): it still writes its (empty) rank file
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self.model = model
        self.tile_offsets = tile_offsets

    def predict_step(self, batch: tuple[list, list], batch_idx: int) -> list[TileDetections]:
        images, tile_ids = batch
        outputs = self.model(images)
        results = []
        for tile_id, out in zip(tile_ids, outputs, strict=True):
            col_off, row_off = self.tile_offsets.get(int(tile_id), (0, 0))
            results.append(
                TileDetections(
                    int(tile_id),
                    col_off,
                    row_off,
                    out["boxes"].float().cpu().numpy(),
                    out["scores"].float().cpu().numpy(),
                    out["labels"].cpu().numpy(),
                )
            )
        return results


def detections_frame(tiles: list[TileDetections], labels: list[str], transform: Any, crs: Any) -> gpd.GeoDataFrame:
    """Tile-pixel detections to raster pixels and CRS polygons, one row per box."""
    rows = [t for t in tiles if len(t.boxes)]
    if not rows:
        return empty_detections(crs)
    boxes = np.concatenate([t.boxes.astype(np.float64) + [t.col_off, t.row_off, t.col_off, t.row_off] for t in rows])
    frame = pd.DataFrame(
        {
            "tile_id": np.concatenate([np.full(len(t.boxes), t.tile_id, dtype=np.int64) for t in rows]),
            "label": np.asarray(labels, dtype=object)[np.concatenate([t.labels for t in rows])],
            "score": np.concatenate([t.scores for t in rows]).astype(np.float32),
            "px_xmin": boxes[:, 0],
            "px_ymin": boxes[:, 1],
            "px_xmax": boxes[:, 2],
            "px_ymax": boxes[:, 3],
        }
    )
    return gpd.GeoDataFrame(frame, geometry=pixel_boxes_to_polygons(boxes, transform), crs=crs)


class RankFileWriter(L.Callback):
    """Collects this rank's detections and writes its rank file (atomically) when prediction ends."""

    def __init__(
        self, out_dir: str | Path, shard: int, labels: list[str], transform: Any, crs: Any, tiles_of_rank: Any
    ) -> None:
        self.out_dir, self.shard, self.labels = Path(out_dir), shard, labels
        self.transform, self.crs, self.tiles_of_rank = transform, crs, tiles_of_rank
        self.results: list[TileDetections] = []
        self.started = time.perf_counter()

    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.results.extend(outputs)

    def write(self, trainer: L.Trainer) -> None:
        """Write this rank's file; called after ``trainer.predict`` returns, also on a rank without tiles
        (Lightning skips the predict hooks there)."""
        rank, world = trainer.global_rank, trainer.world_size
        processed = [r.tile_id for r in self.results]
        assigned = [t.tile_id for t in self.tiles_of_rank(world, rank)]
        if sorted(processed) != sorted(assigned):
            raise RuntimeError(f"rank {rank}: processed {len(processed)} tiles but was assigned {len(assigned)}")
        frame = detections_frame(self.results, self.labels, self.transform, self.crs)
        path = self.out_dir / f"rank-{rank_file_index(self.shard, world, rank)}.parquet"
        write_rank_file(frame, processed, path)
        seconds = time.perf_counter() - self.started
        logging.getLogger(LOGGER_NAME).info(
            "rank %d wrote %s: %d tiles, %d detections, %.1f s (%.2f tiles/s)",
            rank,
            path,
            len(processed),
            len(frame),
            seconds,
            len(processed) / max(seconds, 1e-9),
        )


class PredictionDataModule(L.LightningDataModule):
    """This rank's share of the shard's tiles (known only once the ranks exist).

    A rank may get no tile at all (more ranks than tiles): it still writes its (empty) rank file.
    """

    def __init__(self, dataset_for_rank: Any, batch_size: int, workers: int, pin_memory: bool) -> None:
        super().__init__()
        self.dataset_for_rank, self.batch_size, self.workers, self.pin_memory = (
            dataset_for_rank,
            batch_size,
            workers,
            pin_memory,
        )

    def predict_dataloader(self) -> DataLoader:
        dataset: Dataset = self.dataset_for_rank(self.trainer.world_size, self.trainer.global_rank)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.workers if len(dataset) else 0,
            collate_fn=collate_lists,
            pin_memory=self.pin_memory,
        )


def run_prediction(
    raster_path: str | Path,
    manifest_path: str | Path,
    checkpoint_path: str | Path,
    predict_cfg: dict[str, Any],
    score_threshold: float,
    spec: RunSpec,
    out_dir: str | Path,
    log_dir: str | Path,
    shards: int = 1,
    shard: int = 0,
) -> None:
    rank = current_rank()
    logger = setup_rank_logging(rank, log_dir, name=LOGGER_NAME)
    quiet_non_zero_ranks(rank)
    raster = check_raster(raster_path)
    model, detector, _ = load_checkpoint(checkpoint_path)
    model.score_thresh = score_threshold
    model.eval()
    if spec.accelerator == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(spec.devices, predict_cfg["workers"]))
    tiles = tiles_from_frame(read_manifest(manifest_path))
    offsets = {t.tile_id: (t.col_off, t.row_off) for t in tiles}

    def tiles_of_rank(world: int, rank_: int) -> list[Tile]:
        return rank_tiles(tiles, shards, shard, world, rank_)

    def dataset_for_rank(world: int, rank_: int) -> WindowDataset:
        return WindowDataset(raster_path, tiles_of_rank(world, rank_))

    writer = RankFileWriter(out_dir, shard, list(detector.labels), raster.transform, raster.crs, tiles_of_rank)
    trainer = make_trainer(spec, logger=False, callbacks=[writer], use_distributed_sampler=False)
    if trainer.is_global_zero:
        logger.info("predicting %s: %d tiles, shard %d/%d, %s", raster_path, len(tiles), shard + 1, shards, spec)
    datamodule = PredictionDataModule(
        dataset_for_rank,
        predict_cfg["batch_size"],
        predict_cfg["workers"],
        pin_memory=spec.accelerator == "gpu",
    )
    trainer.predict(DetectorPredictionModule(model, offsets), datamodule=datamodule, return_predictions=False)
    writer.write(trainer)


class ThroughputReport(L.Callback):
    """Counts a rank's tiles and writes its throughput (environment check)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir, self.tiles, self.started = Path(out_dir), 0, time.perf_counter()

    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.tiles += len(batch[0])

    def write(self, trainer: L.Trainer) -> None:
        from rasterscale.outputs import write_json

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


def run_environment_check(
    dummy_cfg: dict[str, Any],
    predict_cfg: dict[str, Any],
    detector: Any,
    spec: RunSpec,
    out_dir: str | Path,
    log_dir: str | Path,
) -> None:
    """DDP prediction of an untrained detector over random tiles: checks ranks, devices and throughput
    without any raster (like the seeds' mgpr with fake data)."""
    from torch.utils.data import Subset

    from rasterscale.data import DummyDataset
    from rasterscale.model import build_detector

    rank = current_rank()
    setup_rank_logging(rank, log_dir, name=LOGGER_NAME)
    quiet_non_zero_ranks(rank)
    dataset = DummyDataset(dummy_cfg["count"], dummy_cfg["size"], dummy_cfg["delay"])
    indices = list(range(len(dataset)))

    def dataset_for_rank(world: int, rank_: int) -> Subset:
        return Subset(dataset, split_balanced(indices, world, rank_))

    model = build_detector(detector).eval()
    report = ThroughputReport(out_dir)
    trainer = make_trainer(spec, logger=False, callbacks=[report], use_distributed_sampler=False)
    datamodule = PredictionDataModule(
        dataset_for_rank, predict_cfg["batch_size"], predict_cfg["workers"], pin_memory=spec.accelerator == "gpu"
    )
    trainer.predict(DetectorPredictionModule(model, {}), datamodule=datamodule, return_predictions=False)
    report.write(trainer)
