"""DDP prediction over the tile manifests of a batch of scenes: every rank reads only its own tiles and writes
its own file per scene.

A job predicts a batch of scenes (its job file lists them: :func:`read_job_file`) with one model load. The
batch's tiles, scene after scene in manifest order, are split into ``shards`` balanced, contiguous parts (one
job, one node each), and each shard into ``world_size`` parts, one per rank; one ``trainer.predict`` runs over
all of a rank's tiles. Rank ``r`` of shard ``s`` writes ``rank-{s * world_size + r}.parquet`` into each scene's
folder, also for a scene it got no tile of: its detections already in the raster's CRS, the tile_ids it
processed and its profile (:mod:`rasterscale.profiling`). No detection crosses ranks; only the small profiles
are gathered, for the table rank 0 prints at the end.

The fast path (:func:`prepare_for_inference`): Lightning's predict runs under ``torch.inference_mode`` and,
with ``predict.precision`` ``bf16-mixed``/``16-mixed``, under autocast (the heads' output layers stay fp32);
batch norms are folded into their convolutions, the model and its input batches are channels_last, tiles
travel as uint8 (pinned, copied non-blocking on GPUs) and are scaled on the device, and dataloader workers
read ahead while the model computes (strategies: :mod:`rasterscale.data`).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
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
from rasterscale.imagery import ImageSpec, read_spec
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


def batch_rank_tiles(
    scene_tiles: Sequence[Sequence[Tile]], shards: int, shard: int, world_size: int, rank: int
) -> list[list[Tile]]:
    """Each scene's tiles of one rank: the batch's tiles, scene after scene, split as :func:`rank_tiles` splits
    one scene's (so that many small scenes balance over the ranks as one large one does)."""
    keyed = [(index, tile) for index, tiles in enumerate(scene_tiles) for tile in tiles]
    own: list[list[Tile]] = [[] for _ in scene_tiles]
    for index, tile in rank_tiles(keyed, shards, shard, world_size, rank):
        own[index].append(tile)
    return own


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


def split_key(key: Any) -> tuple[int, int]:
    """(scene index, tile_id) of a dataset item's key: a (scene, tile_id) pair, or a bare id (one scene)."""
    return (int(key[0]), int(key[1])) if isinstance(key, tuple | list) else (0, int(key))


@dataclass
class TileDetections:
    scene: int  # index of the scene in the job
    tile_id: int
    col_off: int
    row_off: int
    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray


class DetectorPredictionModule(L.LightningModule):
    def __init__(self, model: torch.nn.Module, tile_offsets: dict[tuple[int, int], tuple[int, int]]) -> None:
        super().__init__()
        # a rank may get no tile (more ranks than tiles): it still writes its (empty) rank file
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self.model = model
        self.tile_offsets = tile_offsets

    def predict_step(self, batch: tuple[list, list], batch_idx: int) -> list[TileDetections]:
        images, keys = batch
        outputs = self.model([to_model_input(image) for image in images])
        results = []
        for key, out in zip(keys, outputs, strict=True):
            scene, tile_id = split_key(key)
            col_off, row_off = self.tile_offsets.get((scene, tile_id), (0, 0))
            results.append(
                TileDetections(
                    scene,
                    tile_id,
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


@dataclass
class Share:
    """What a rank spent on one scene (or on all): tiles, batches, and the wall and compute time of its batches,
    a batch's time split between its scenes by their tiles (so that the scenes' walls add up to the rank's)."""

    tiles: int = 0
    batches: int = 0
    wall_s: float = 0.0
    compute_s: float = 0.0
    memory: list[int] = field(default_factory=list)

    def add(self, tiles: int, fraction: float, wall: float, compute: float, memory: int) -> None:
        self.tiles += tiles
        self.batches += 1
        self.wall_s += wall * fraction
        self.compute_s += compute * fraction
        self.memory.append(memory)


class PredictProfiler(L.Callback):
    """Measures one rank's prediction batch by batch (:mod:`rasterscale.profiling` says what and how), in all
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
            memory = torch.cuda.max_memory_allocated(self.device)
        else:
            memory = rss_now()
        now = time.perf_counter()
        wall, compute = now - self.mark, now - self.batch_started
        self.mark, self.cpu_mark = now, time.process_time()
        keys = batch[1]
        self.total.add(len(keys), 1.0, wall, compute, memory)
        counts = np.bincount([split_key(key)[0] for key in keys])
        for scene in np.flatnonzero(counts):
            share = self.scenes.setdefault(int(scene), Share())
            share.add(int(counts[scene]), counts[scene] / len(keys), wall, compute, memory)
        if now - self.workers_sampled >= WORKER_SAMPLE_PERIOD_S:
            self.workers_peak, self.workers_sampled = max(self.workers_peak, workers_rss()), now

    def finish(self, trainer: L.Trainer, scene: int | None = None) -> RankProfile:
        """The rank's profile of one scene of the job, or of all (also for a rank without tiles, where Lightning
        ran no batch). The utilization is the rank's over the job."""
        share = self.total if scene is None else self.scenes.get(scene, Share())
        rank_wall = self.mark - self.started if self.total.batches else 0.0
        wall = share.wall_s
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
            wait_s=round(wall - share.compute_s, 4),
            wait_fraction=round((wall - share.compute_s) / wall, 4) if wall > 0 else 0.0,
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


def gather_to_all(trainer: L.Trainer, item: Any) -> list[Any]:
    """Every rank's ``item`` (a small picklable object) on every rank of the job; never used for detections."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        items: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(items, item)
        return items
    return [item]


class RankFileWriter(L.Callback):
    """Collects this rank's detections and writes its rank file of every scene of the job (atomically, with the
    rank's profile of that scene in its metadata) when prediction ends."""

    def __init__(
        self,
        scenes: Sequence[PredictScene],
        shard: int,
        labels: list[str],
        tiles_of_rank: Any,
        profiler: PredictProfiler,
    ) -> None:
        self.scenes, self.shard, self.labels = list(scenes), shard, labels
        self.tiles_of_rank = tiles_of_rank
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
        """Write this rank's file of each scene; called after ``trainer.predict`` returns, also on a rank
        without tiles (Lightning skips the predict hooks there): a scene it got no tile of gets an empty file."""
        rank, world = trainer.global_rank, trainer.world_size
        assigned = self.tiles_of_rank(world, rank)
        by_scene: list[list[TileDetections]] = [[] for _ in self.scenes]
        for result in self.results:
            by_scene[result.scene].append(result)
        logger = logging.getLogger(LOGGER_NAME)
        for index, (scene, results) in enumerate(zip(self.scenes, by_scene, strict=True)):
            processed = [r.tile_id for r in results]
            if sorted(processed) != sorted(t.tile_id for t in assigned[index]):
                raise RuntimeError(
                    f"rank {rank}, scene {scene.job.name}: processed {len(processed)} tiles "
                    f"but was assigned {len(assigned[index])}"
                )
            frame = detections_frame(results, self.labels, scene.transform, scene.crs)
            path = Path(scene.job.out_dir) / f"rank-{rank_file_index(self.shard, world, rank)}.parquet"
            profile = self.profiler.finish(trainer, index)
            write_rank_file(frame, processed, path, metadata=profile_metadata(profile))
            logger.info(
                "rank %d wrote %s: %d tiles, %d detections, %.1f s",
                rank,
                path,
                len(processed),
                len(frame),
                profile.wall_s,
            )
        seconds = time.perf_counter() - self.started
        logger.info(
            "rank %d: %d scene(s), %d tiles, %.1f s (%.2f tiles/s)",
            rank,
            len(self.scenes),
            len(self.results),
            seconds,
            len(self.results) / max(seconds, 1e-9),
        )
        # also a barrier: the job ends only once every rank has written its files
        profiles = gather_to_all(trainer, asdict(self.profiler.finish(trainer)))
        if trainer.is_global_zero:
            title = f"predict profile, shard {self.shard}"
            logger.info("%s", format_profile_table(summarize(profiles), title=title))


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


@dataclass(frozen=True)
class SceneJob:
    """One scene of a prediction job, as its job file lists it: raster, tile manifest, folder of rank files."""

    name: str
    raster: str
    manifest: str
    out_dir: str


def read_job_file(path: str | Path) -> list[SceneJob]:
    """The scenes of a batch's job file (rule scene_batch), in order."""
    scenes = json.loads(Path(path).read_text())["scenes"]
    return [SceneJob(s["name"], s["raster"], s["manifest"], s["out_dir"]) for s in scenes]


@dataclass(frozen=True)
class PredictScene:
    """A scene of the job with what prediction needs of it: its tiles, its imagery spec (from the manifest) and
    its raster's georeference."""

    job: SceneJob
    tiles: list[Tile]
    imagery: ImageSpec
    transform: Any
    crs: Any

    @classmethod
    def load(cls, job: SceneJob) -> PredictScene:
        raster = check_raster(job.raster)
        tiles = tiles_from_frame(read_manifest(job.manifest))
        return cls(job, tiles, read_spec(job.manifest), raster.transform, raster.crs)


def scene_dataset(
    strategy: str, raster_path: str, tiles: list[Tile], imagery: ImageSpec, device: torch.device
) -> Dataset:
    """One scene's tiles of a rank under the strategy (single and batch read the rank's region of it here)."""
    if strategy != "window" and tiles:
        logging.getLogger(LOGGER_NAME).info(
            "strategy %s holds the region of %s of %.0f MB on %s",
            strategy,
            raster_path,
            region_nbytes(bounding_window(tiles)) / 2**20,
            device if strategy == "batch" else "cpu",
        )
    return prediction_dataset(strategy, raster_path, tiles, imagery, device)


class ScenesDataset(Dataset):
    """Several scenes' tiles, scene after scene: item -> (image, (scene index, tile_id)).

    A scene's dataset is made when its first tile is asked for and dropped when the next scene's is, so that a
    process holds one scene's region (strategies single and batch) or raster handle at a time: items must be
    asked for in order, as a prediction dataloader does (each worker process goes forward through its batches).
    """

    def __init__(self, factories: Sequence[Any], sizes: Sequence[int]) -> None:
        self.factories = list(factories)
        self.starts = np.cumsum([0, *sizes])
        self.current: tuple[int, Dataset] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "current": None}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, tuple[int, int]]:
        scene = int(np.searchsorted(self.starts, index, side="right")) - 1
        if self.current is None or self.current[0] != scene:
            self.current = None  # the previous scene's region goes before the next one's is read
            self.current = (scene, self.factories[scene]())
        image, tile_id = self.current[1][index - int(self.starts[scene])]
        return image, (scene, int(tile_id))


def run_prediction(
    scenes: Sequence[SceneJob],
    checkpoint_path: str | Path,
    config: dict[str, Any],
    spec: RunSpec,
    log_dir: str | Path,
    shards: int = 1,
    shard: int = 0,
) -> None:
    """Predict one shard of a batch of scenes with one model load and one ``trainer.predict`` per rank.
    ``config``: the validated config's ``predict`` section and any ``model.*`` keys set (they override the model
    file's)."""
    predict_cfg = config["predict"]
    rank = current_rank()
    logger = setup_rank_logging(rank, log_dir, name=LOGGER_NAME)
    quiet_non_zero_ranks(rank)
    limit_read_cache(predict_cfg["read_cache_mb"])
    # every model.* key set in the config overrides what the model file says
    model, detector, _ = load_checkpoint(checkpoint_path, config)
    prepare_for_inference(model, channels_last=predict_cfg["channels_last"])
    warn_if_slow_precision(spec, logger)
    if spec.accelerator == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(spec.devices))
    loaded = [PredictScene.load(job) for job in scenes]
    offsets = {(i, t.tile_id): (t.col_off, t.row_off) for i, scene in enumerate(loaded) for t in scene.tiles}
    strategy = predict_cfg["strategy"]
    workers = loader_workers(strategy, predict_cfg["workers"])

    @functools.cache
    def tiles_of_rank(world: int, rank_: int) -> list[list[Tile]]:
        return batch_rank_tiles([scene.tiles for scene in loaded], shards, shard, world, rank_)

    def dataset_for_rank(world: int, rank_: int, device: torch.device) -> Dataset:
        own = tiles_of_rank(world, rank_)
        factories = [
            functools.partial(scene_dataset, strategy, scene.job.raster, tiles, scene.imagery, device)
            for scene, tiles in zip(loaded, own, strict=True)
        ]
        return ScenesDataset(factories, [len(tiles) for tiles in own])

    profiler = PredictProfiler(strategy, predict_cfg["batch_size"], workers, shard)
    writer = RankFileWriter(loaded, shard, list(detector.labels), tiles_of_rank, profiler)
    trainer = make_trainer(
        spec,
        logger=False,
        callbacks=[profiler, writer],
        use_distributed_sampler=False,
        benchmark=spec.accelerator == "gpu",  # all tiles have one size: let cuDNN pick its fastest kernels
    )
    if trainer.is_global_zero:
        logger.info("model %s: %s", checkpoint_path, detector.describe())
        logger.info(
            "predicting %d scene(s) (%s): %d tiles, shard %d/%d, %s, strategy %s, batch %d per device, "
            "%d worker(s) per rank",
            len(loaded),
            ", ".join(scene.job.name for scene in loaded[:5]) + (", ..." if len(loaded) > 5 else ""),
            len(offsets),
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
