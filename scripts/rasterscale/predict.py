"""DDP prediction over a tile manifest: every rank reads only its own tiles and writes its own file.

The manifest is split into ``shards`` balanced, contiguous parts (one job, one node each), and each shard into
``world_size`` parts, one per rank. Rank ``r`` of shard ``s`` writes ``rank-{s * world_size + r}.parquet``:
its detections already in the raster's CRS, the tile_ids it processed and its profile
(:mod:`rasterscale.profiling`). No detection crosses ranks; only the small profiles are gathered, for the table
rank 0 prints at the end.

The fast path (:func:`prepare_for_inference`): Lightning's predict runs under ``torch.inference_mode`` and,
with ``predict.precision`` ``bf16-mixed``/``16-mixed``, under autocast (the heads' output layers stay fp32);
batch norms are folded into their convolutions, the model and its input batches are channels_last, tiles
travel as uint8 (pinned, copied non-blocking on GPUs) and are scaled on the device, and dataloader workers
read ahead while the model computes (strategies: :mod:`rasterscale.data`).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import geopandas as gpd
import lightning as L
import numpy as np
import pandas as pd
import torch
from torch.nn.utils.fusion import fuse_conv_bn_eval
from torch.utils.data import DataLoader, Dataset

from rasterscale.data import (
    bounding_window,
    collate_lists,
    limit_read_cache,
    loader_workers,
    prediction_dataset,
    region_nbytes,
    to_model_input,
)
from rasterscale.geo import pixel_boxes_to_polygons
from rasterscale.imagery import read_spec
from rasterscale.inputs import check_raster
from rasterscale.merge import empty_detections, write_rank_file
from rasterscale.model import load_checkpoint
from rasterscale.profiling import (
    MB,
    WORKER_SAMPLE_PERIOD_S,
    RankProfile,
    UtilizationSampler,
    format_profile_table,
    host_memory_total,
    host_name,
    peak_rss,
    profile_metadata,
    rss_now,
    summarize,
    workers_rss,
)
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


def fuse_conv_bn(module: torch.nn.Module) -> int:
    """Fold every eval-mode batch norm into the convolution that feeds it (ResNet's ``convN``/``bnN`` pairs and
    ``Sequential(conv, bn)`` shortcuts); the norm becomes an identity. Returns how many were folded."""
    fused = 0
    for parent in list(module.modules()):
        children = parent._modules
        if isinstance(parent, torch.nn.Sequential):
            names = list(children)
            pairs = list(itertools.pairwise(names))
        else:
            pairs = [(f"conv{k}", f"bn{k}") for k in ("", 1, 2, 3)]
        for conv_name, bn_name in pairs:
            conv, bn = children.get(conv_name), children.get(bn_name)
            if isinstance(conv, torch.nn.Conv2d) and isinstance(bn, torch.nn.BatchNorm2d) and not bn.training:
                children[conv_name] = fuse_conv_bn_eval(conv, bn)
                children[bn_name] = torch.nn.Identity()
                fused += 1
    return fused


class Float32Output(torch.nn.Module):
    """Runs a layer outside autocast, in fp32: for the heads' last convolutions, whose outputs are the box
    deltas and class logits. Cheap (a few output channels), and it keeps box coordinates at fp32 accuracy
    (bf16's 8-bit mantissa on the deltas moves boxes by pixels)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.layer(x.float())


def channels_last_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def prepare_for_inference(model: torch.nn.Module, channels_last: bool = True) -> torch.nn.Module:
    """The detector's fast path: eval mode, batch norms folded into convolutions, the heads' output layers in
    fp32 under autocast, and (when asked) channels_last weights and input batches, which oneDNN and cuDNN
    convolutions run fastest."""
    model.eval()
    fuse_conv_bn(model)
    head = model.head
    head.regression_head.bbox_reg = Float32Output(head.regression_head.bbox_reg)
    head.classification_head.cls_logits = Float32Output(head.classification_head.cls_logits)
    if channels_last:
        model.to(memory_format=torch.channels_last)
        model.backbone.register_forward_pre_hook(channels_last_input)
    return model


def warn_if_slow_precision(spec: RunSpec, logger: logging.Logger) -> None:
    """bf16 autocast on a CPU without native bf16 (AVX512-BF16 or AMX) is emulated, slower than fp32."""
    if spec.accelerator == "cpu" and spec.precision.startswith("bf16"):
        supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if not supported:
            logger.warning("this CPU has no native bf16: predict.precision '32-true' is likely faster")


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
        outputs = self.model([to_model_input(image) for image in images])
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


class PredictProfiler(L.Callback):
    """Measures one rank's prediction batch by batch (:mod:`rasterscale.profiling` says what and how);
    :meth:`finish` returns the rank's :class:`RankProfile`."""

    def __init__(self, strategy: str, batch_size: int, workers: int, shard: int = 0) -> None:
        self.strategy, self.batch_size, self.workers, self.shard = strategy, batch_size, workers, shard
        self.device = torch.device("cpu")
        self.started = self.mark = self.batch_started = time.perf_counter()
        self.cpu_started = self.cpu_mark = time.process_time()
        self.tiles = self.batches = 0
        self.compute_s = 0.0
        self.memory: list[int] = []
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

    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            self.memory.append(torch.cuda.max_memory_allocated(self.device))
        else:
            self.memory.append(rss_now())
        now = time.perf_counter()
        self.compute_s += now - self.batch_started
        self.mark, self.cpu_mark = now, time.process_time()
        self.tiles += len(batch[0])
        self.batches += 1
        if now - self.workers_sampled >= WORKER_SAMPLE_PERIOD_S:
            self.workers_peak, self.workers_sampled = max(self.workers_peak, workers_rss()), now

    def finish(self, trainer: L.Trainer) -> RankProfile:
        """The rank's profile (also for a rank without tiles, where Lightning ran no batch)."""
        wall = self.mark - self.started if self.batches else 0.0
        if self.on_gpu:
            threads = 1
            utilization = self.sampler.stop() if self.sampler is not None else None
            source = "nvml" if utilization is not None else "unavailable"
            total = torch.cuda.get_device_properties(self.device).total_memory
            device = f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        else:
            threads = torch.get_num_threads()
            utilization = (self.cpu_mark - self.cpu_started) / (wall * threads) if wall > 0 else None
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
            tiles=self.tiles,
            batches=self.batches,
            wall_s=round(wall, 4),
            compute_s=round(self.compute_s, 4),
            wait_s=round(wall - self.compute_s, 4),
            wait_fraction=round((wall - self.compute_s) / wall, 4) if wall > 0 else 0.0,
            batches_per_s=rate(self.batches),
            tiles_per_s=rate(self.tiles),
            memory_kind="cuda_allocated" if self.on_gpu else "host_rss",
            memory_peak_mb=round(max(self.memory, default=0) / MB, 1),
            memory_mean_mb=round(sum(self.memory) / len(self.memory) / MB, 1) if self.memory else 0.0,
            memory_total_mb=round(total / MB, 1),
            utilization=round(utilization, 4) if utilization is not None else None,
            utilization_source=source,
            host_rss_peak_mb=round(peak_rss() / MB, 1),
            workers_rss_peak_mb=round(max(self.workers_peak, workers_rss()) / MB, 1),
        )


def gather_to_all(trainer: L.Trainer, item: Any) -> list[Any]:
    """Every rank's ``item`` (a small picklable object) on every rank of the job; never used for detections."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        items: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(items, item)
        return items
    return [item]


class RankFileWriter(L.Callback):
    """Collects this rank's detections and writes its rank file (atomically, with the rank's profile in its
    metadata) when prediction ends."""

    def __init__(
        self,
        out_dir: str | Path,
        shard: int,
        labels: list[str],
        transform: Any,
        crs: Any,
        tiles_of_rank: Any,
        profiler: PredictProfiler,
    ) -> None:
        self.out_dir, self.shard, self.labels = Path(out_dir), shard, labels
        self.transform, self.crs, self.tiles_of_rank = transform, crs, tiles_of_rank
        self.profiler = profiler
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
        profile = self.profiler.finish(trainer)
        processed = [r.tile_id for r in self.results]
        assigned = [t.tile_id for t in self.tiles_of_rank(world, rank)]
        if sorted(processed) != sorted(assigned):
            raise RuntimeError(f"rank {rank}: processed {len(processed)} tiles but was assigned {len(assigned)}")
        frame = detections_frame(self.results, self.labels, self.transform, self.crs)
        path = self.out_dir / f"rank-{rank_file_index(self.shard, world, rank)}.parquet"
        write_rank_file(frame, processed, path, metadata=profile_metadata(profile))
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
        # also a barrier: the job ends only once every rank has written its file
        profiles = gather_to_all(trainer, asdict(profile))
        if trainer.is_global_zero:
            title = f"predict profile, shard {self.shard}"
            logging.getLogger(LOGGER_NAME).info("%s", format_profile_table(summarize(profiles), title=title))


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
        trainer = self.trainer
        dataset: Dataset = self.dataset_for_rank(trainer.world_size, trainer.global_rank, trainer.strategy.root_device)
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
    config: dict[str, Any],
    spec: RunSpec,
    out_dir: str | Path,
    log_dir: str | Path,
    shards: int = 1,
    shard: int = 0,
) -> None:
    rank = current_rank()
    logger = setup_rank_logging(rank, log_dir, name=LOGGER_NAME)
    quiet_non_zero_ranks(rank)
    limit_read_cache(predict_cfg["read_cache_mb"])
    raster = check_raster(raster_path)
    # every model.* key set in the config overrides what the model file says
    model, detector, _ = load_checkpoint(checkpoint_path, config)
    prepare_for_inference(model, channels_last=predict_cfg["channels_last"])
    warn_if_slow_precision(spec, logger)
    if spec.accelerator == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(spec.devices))
    tiles = tiles_from_frame(read_manifest(manifest_path))
    imagery = read_spec(manifest_path)
    offsets = {t.tile_id: (t.col_off, t.row_off) for t in tiles}
    strategy = predict_cfg["strategy"]
    workers = loader_workers(strategy, predict_cfg["workers"])

    def tiles_of_rank(world: int, rank_: int) -> list[Tile]:
        return rank_tiles(tiles, shards, shard, world, rank_)

    def dataset_for_rank(world: int, rank_: int, device: torch.device) -> Dataset:
        own = tiles_of_rank(world, rank_)
        if strategy != "window" and own:
            logger.info(
                "rank %d: strategy %s holds its region of %.0f MB on %s",
                rank_,
                strategy,
                region_nbytes(bounding_window(own)) / 2**20,
                device if strategy == "batch" else "cpu",
            )
        return prediction_dataset(strategy, raster_path, own, imagery, device)

    profiler = PredictProfiler(strategy, predict_cfg["batch_size"], workers, shard)
    writer = RankFileWriter(
        out_dir, shard, list(detector.labels), raster.transform, raster.crs, tiles_of_rank, profiler
    )
    trainer = make_trainer(
        spec,
        logger=False,
        callbacks=[profiler, writer],
        use_distributed_sampler=False,
        benchmark=spec.accelerator == "gpu",  # all tiles have one size: let cuDNN pick its fastest kernels
    )
    if trainer.is_global_zero:
        logger.info(
            "model %s: labels %s, %s, score %.3g, nms %.3g, %d detections per tile",
            checkpoint_path,
            ", ".join(detector.labels),
            detector.describe_resize(),
            detector.score_threshold,
            detector.nms_threshold,
            detector.detections_per_tile,
        )
        logger.info(
            "predicting %s: %d tiles, shard %d/%d, %s, strategy %s, batch %d per device, %d worker(s) per rank",
            raster_path,
            len(tiles),
            shard + 1,
            shards,
            spec,
            strategy,
            predict_cfg["batch_size"],
            workers,
        )
    datamodule = PredictionDataModule(
        dataset_for_rank,
        predict_cfg["batch_size"],
        workers,
        pin_memory=spec.accelerator == "gpu" and strategy != "batch",
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

    def dataset_for_rank(world: int, rank_: int, device: torch.device) -> Subset:
        return Subset(dataset, split_balanced(indices, world, rank_))

    model = prepare_for_inference(build_detector(detector), channels_last=predict_cfg["channels_last"])
    report = ThroughputReport(out_dir)
    trainer = make_trainer(spec, logger=False, callbacks=[report], use_distributed_sampler=False)
    datamodule = PredictionDataModule(
        dataset_for_rank, predict_cfg["batch_size"], predict_cfg["workers"], pin_memory=spec.accelerator == "gpu"
    )
    trainer.predict(DetectorPredictionModule(model, {}), datamodule=datamodule, return_predictions=False)
    report.write(trainer)
