"""DDP prediction over the tile manifests of a batch of scenes, whatever the task: every rank reads only its own
tiles and writes its own files per scene.

A job predicts a batch of scenes (its job file lists them: :mod:`rasterscale.jobs.files`) with one model load.
The batch's tiles, scene after scene in manifest order, are split into ``shards`` balanced, contiguous parts (one
job, one node each), and each shard into ``world_size`` parts, one per rank (:mod:`rasterscale.grid.sharding`); one
``trainer.predict`` runs over all of a rank's tiles (and the neighbours a task needs of them:
:meth:`~rasterscale.tasks.api.Task.tiles_to_predict`). For each scene of the job, also one it got no tile of,
rank ``r`` of shard ``s`` writes into ``{out_dir}/{scene}/`` its task's output ``rank-{s * world_size + r}.*`` and
then its record ``rank-{i}.json``: the tiles it processed and its profile (:mod:`rasterscale.jobs.rankfiles`). No
prediction crosses ranks; only the small profiles are gathered, for the table rank 0 prints at the end.

With a resume folder (the rule's: :func:`rasterscale.jobs.resume.resume_dir`), each rank also saves its
finished tiles there every ``predict.save_every`` seconds, and a rerun of the job skips the tiles its saved parts
hold (:mod:`rasterscale.jobs.resume`); the job removes the folder once every rank has written its files.

Tiles travel as uint8, a batch as one tensor (:mod:`rasterscale.predict.batches`: pinned, copied non-blocking on
GPUs), and are scaled on the device; dataloader workers read ahead while the model computes (strategies:
:mod:`rasterscale.datasets.tiles`; workers from the rank's cores: :mod:`rasterscale.runtime.cores`). A batch's
result stays on the device until its scene's rank output takes it, in one call (a blend runs there too:
:mod:`rasterscale.tasks.blender`). Every stage of a batch is timed on the rank's stage clock
(:class:`~rasterscale.predict.measure.StageClock`). Lightning's predict runs under
``torch.inference_mode`` and, where ``predict.precision`` resolves to ``bf16-mixed``/``16-mixed`` on the rank's device
(:mod:`rasterscale.runtime.precision`), under autocast; the task puts its model on its fast path
(:mod:`rasterscale.runtime.fastpath`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from rasterscale.datasets.tiles import (
    limit_read_cache,
    loader_workers,
    to_model_input,
)
from rasterscale.grid.manifest import read_grid, read_manifest, tiles_from_frame
from rasterscale.grid.sharding import batch_rank_tiles, rank_file_index
from rasterscale.grid.tile import Tile
from rasterscale.jobs.paths import rank_stem
from rasterscale.jobs.profile import format_profile_table, summarize
from rasterscale.jobs.rankfiles import write_rank_record
from rasterscale.jobs.resume import (
    RankSaves,
    SaveClock,
    file_digest,
    prediction_fingerprint,
    remove_resume_dir,
)
from rasterscale.predict.batches import LOGGER_NAME, TileBatch, collate_tiles, rank_dataset
from rasterscale.predict.measure import PredictProfiler, StageClock
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import read_spec
from rasterscale.runtime.cores import prefetch_factor, rank_workers
from rasterscale.runtime.lifetime import bind_worker
from rasterscale.runtime.ranks import RankLayout, attached_trainer, end_rank, gather_to_all, make_trainer, start_rank
from rasterscale.scene import Scene
from rasterscale.settings import Settings
from rasterscale.tasks.api import PredictScene, RankOutput, Task
from rasterscale.tasks.registry import task_spec


def load_scene(job: Scene) -> PredictScene:
    """A scene with what prediction needs of it: its tiles and imagery spec (from the manifest), its raster's
    size and georeference."""
    raster = check_raster(job.raster)
    tiles = tiles_from_frame(read_manifest(job.manifest))
    spec, grid = read_spec(job.manifest), read_grid(job.manifest)
    return PredictScene(
        job.name, job.raster, tiles, spec, grid, raster.width, raster.height, raster.transform, raster.crs
    )


@dataclass(frozen=True)
class RankPlan:
    """One rank's tiles of each scene of the job: its own (it accounts for them) and those it predicts, and its
    saved parts of each scene (None without a resume folder)."""

    own: list[list[Tile]]
    predicted: list[list[Tile]]
    saves: list[RankSaves] | None = None


class PredictionModule(L.LightningModule):
    """The task's model over a batch of tiles (uint8 scaled on the device, or raw float values), then the task's
    post-processing, lap by lap on the rank's stage clock (the data module's laps come first: the wait and the
    copy). Returns the batch's ``(keys, result, read seconds)``: each tile's (scene index, position in the rank's
    predicted tiles of the scene), the batch's result on the device
    (:meth:`~rasterscale.tasks.api.Task.postprocess`), and the dataloader's time reading it."""

    def __init__(self, task: Task, model: torch.nn.Module, clock: StageClock) -> None:
        super().__init__()
        # a rank may get no tile (more ranks than tiles): it still writes its (empty) rank files
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self.task, self.model, self.clock = task, model, clock

    def predict_step(self, batch: TileBatch, batch_idx: int) -> tuple[list[tuple[int, int]], Any, float]:
        images, keys, read_s = batch
        images = to_model_input(images)
        self.clock.lap("h2d")
        raw = self.task.forward(self.model, images)
        self.clock.lap("forward")
        result = self.task.postprocess(raw)
        self.clock.lap("post")
        return keys, result, read_s


def scene_runs(keys: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """A batch's keys cut where the scene changes: (scene, start, stop) of each run."""
    runs: list[tuple[int, int, int]] = []
    for index, (scene, _) in enumerate(keys):
        if runs and runs[-1][0] == scene:
            runs[-1] = (scene, runs[-1][1], index + 1)
        else:
            runs.append((scene, index, index + 1))
    return runs


class RankPlans:
    """Each rank's :class:`RankPlan` of the job's scenes, made once per (world size, rank) when first asked for
    (the ranks exist once the trainer runs): its own tiles of the shard and, with a resume folder, its saved parts
    of each scene, whose tiles it does not predict again."""

    def __init__(
        self,
        task: Task,
        scenes: Sequence[PredictScene],
        settings: Settings,
        shards: int,
        shard: int,
        resume: tuple[str | Path, str] | None,
        logger: logging.Logger,
    ) -> None:
        """``resume``: the resume folder and the model file's digest (None: no resume folder)."""
        self.task, self.scenes, self.settings, self.shards, self.shard = task, list(scenes), settings, shards, shard
        self.resume, self.logger = resume, logger
        self.plans: dict[tuple[int, int], RankPlan] = {}

    def __call__(self, world: int, rank: int) -> RankPlan:
        if (world, rank) not in self.plans:
            self.plans[world, rank] = self.plan(world, rank)
        return self.plans[world, rank]

    def plan(self, world: int, rank: int) -> RankPlan:
        own = batch_rank_tiles([scene.tiles for scene in self.scenes], self.shards, self.shard, world, rank)
        if self.resume is None:
            return RankPlan(own, self.predicted(own))
        saves = self.saves(world, rank, *self.resume)
        remaining = [[t for t in ts if t.tile_id not in c.resumed] for ts, c in zip(own, saves, strict=True)]
        predicted = self.predicted(remaining)
        done = sum(len(ranked.resumed) for ranked in saves)
        if done:
            self.logger.info(
                "resuming: %d of %d tiles already done in %s; predicting %d tiles",
                done,
                sum(len(tiles) for tiles in own),
                self.resume[0],
                sum(len(tiles) for tiles in predicted),
            )
        return RankPlan(own, predicted, saves)

    def predicted(self, tiles: Sequence[Sequence[Tile]]) -> list[list[Tile]]:
        """The tiles the task predicts for these tiles of each scene (:meth:`Task.tiles_to_predict`)."""
        return [self.task.tiles_to_predict(scene, ts) for scene, ts in zip(self.scenes, tiles, strict=True)]

    def saves(self, world: int, rank: int, resume_dir: str | Path, model_digest: str) -> list[RankSaves]:
        """The rank's saved parts of each scene in ``resume_dir``, loaded (those of this very prediction only:
        :func:`~rasterscale.jobs.resume.prediction_fingerprint`)."""
        saves = []
        for scene in self.scenes:
            tiles = [t.tile_id for t in scene.tiles]
            mark = prediction_fingerprint(self.settings, model_digest, world, self.shards, self.shard, tiles)
            index = rank_file_index(self.shard, world, rank)
            saves.append(RankSaves(resume_dir, scene.name, index, self.task.spec.rank_suffix, mark))
            saves[-1].load(self.logger)
        return saves


class RankOutputs:
    """Makes a rank's output of a scene (the task's), at ``{out_dir}/{scene}/rank-{i}{suffix}``."""

    def __init__(
        self,
        task: Task,
        scenes: Sequence[PredictScene],
        plan_of_rank: Callable[[int, int], RankPlan],
        out_dir: str | Path,
        shard: int,
        model_cfg: Any,
        settings: Settings,
    ) -> None:
        self.task, self.scenes, self.plan_of_rank = task, list(scenes), plan_of_rank
        self.out_dir, self.shard, self.model_cfg, self.settings = out_dir, shard, model_cfg, settings

    def stem(self, world: int, rank: int, scene: int) -> str:
        return rank_stem(self.out_dir, self.scenes[scene].name, rank_file_index(self.shard, world, rank))

    def __call__(self, world: int, rank: int, scene: int, device: torch.device) -> RankOutput:
        plan: RankPlan = self.plan_of_rank(world, rank)
        path = self.stem(world, rank, scene) + self.task.spec.rank_suffix
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        parts = plan.saves[scene].parts if plan.saves is not None else None
        return self.task.rank_output(
            self.scenes[scene],
            plan.own[scene],
            plan.predicted[scene],
            path,
            self.model_cfg,
            self.settings,
            parts,
            device=device,
        )


class BatchEndCallback(L.Callback):
    """A callback told of each predicted batch (Lightning's ``on_predict_batch_end``, narrowed to what it uses)."""

    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.batch_predicted(trainer, outputs, batch)

    def batch_predicted(self, trainer: L.Trainer, outputs: Any, batch: Any) -> None:
        """A batch is predicted: ``outputs``, what the module's ``predict_step`` returned of ``batch``."""
        raise NotImplementedError


class RankWriter(BatchEndCallback):
    """Feeds each predicted tile's result to its scene's rank output (in prediction order), then ends the batch
    in the profile with the time that took, and, when prediction ends, writes every scene's output and record (the
    record last: it vouches for a complete output)."""

    def __init__(
        self,
        scenes: Sequence[PredictScene],
        outputs: RankOutputs,
        profiler: PredictProfiler,
        resume_dir: str | Path | None = None,
        save_every: float = 60.0,
    ) -> None:
        self.scenes, self.outputs, self.profiler = list(scenes), outputs, profiler
        self.resume_dir, self.clock = resume_dir, SaveClock(save_every)
        self.open: dict[int, RankOutput] = {}
        self.seen: list[np.ndarray] | None = None
        self.started = time.perf_counter()

    def output(self, trainer: L.Trainer, scene: int) -> RankOutput:
        if scene not in self.open:
            device = trainer.strategy.root_device
            self.open[scene] = self.outputs(trainer.world_size, trainer.global_rank, scene, device)
        return self.open[scene]

    def plan(self, trainer: L.Trainer) -> RankPlan:
        return self.outputs.plan_of_rank(trainer.world_size, trainer.global_rank)

    def batch_predicted(self, trainer: L.Trainer, outputs: Any, batch: Any) -> None:
        """Each scene's tiles of the batch to its rank output in one call (a blend: the ``blend`` stage, less what
        the output spent copying results to the host or waiting for its writer), then the parts due (``write``)."""
        keys, result, read_s = outputs
        plan = self.plan(trainer)
        if self.seen is None:
            self.seen = [np.zeros(len(tiles), dtype=np.int64) for tiles in plan.predicted]
        clock = self.profiler.clock
        moved = {"d2h": 0.0, "write": 0.0}
        for scene, start, stop in scene_runs(keys):
            positions = [position for _, position in keys[start:stop]]
            np.add.at(self.seen[scene], positions, 1)
            output = self.output(trainer, scene)
            before = output.stage_seconds()
            output.add_batch([plan.predicted[scene][p] for p in positions], result[start:stop])
            after = output.stage_seconds()
            for stage, target in (("d2h", "d2h"), ("write_wait", "write")):
                moved[target] += after.get(stage, 0.0) - before.get(stage, 0.0)
        clock.lap("blend")
        for target, seconds in moved.items():
            clock.move(seconds, "blend", target)
        if plan.saves is not None:
            self.save_parts(plan, plan.saves)
        clock.lap("write")
        self.profiler.end_batch(keys, read_s)

    def save_parts(self, plan: RankPlan, saves: Sequence[RankSaves]) -> None:
        """Each open scene's finished tiles not in a part yet, as a part (when the clock says so, or the scene's
        output holds much of them), and a line of progress."""
        due = self.clock.due()
        for scene, output in self.open.items():
            if due or self.clock.due(output.unsaved_bytes()):
                ranked = saves[scene]
                part = output.save_part(ranked.next_part_path())
                if part is not None:
                    ranked.commit(part)
                    logging.getLogger(LOGGER_NAME).info(
                        "saved %s: %d of %d own tiles of %s done",
                        part.path.name,
                        len(ranked.done),
                        len(plan.own[scene]),
                        self.scenes[scene].name,
                    )
        if due:
            self.clock.reset()

    def write(self, trainer: L.Trainer) -> None:
        """Write this rank's files of each scene; called after ``trainer.predict`` returns, also on a rank
        without tiles (Lightning skips the predict hooks there)."""
        rank, world = trainer.global_rank, trainer.world_size
        plan = self.plan(trainer)
        logger = logging.getLogger(LOGGER_NAME)
        for index, scene in enumerate(self.scenes):
            count = len(plan.predicted[index])
            seen = self.seen[index] if self.seen is not None else np.zeros(count, dtype=np.int64)
            if (seen != 1).any():
                raise RuntimeError(
                    f"rank {rank}, scene {scene.name}: {int((seen == 1).sum())} of {count} tiles predicted once"
                )
            output = self.output(trainer, index)
            summary = output.write()
            self.profiler.end_write(index)
            self.profiler.add_parallel("writer", output.stage_seconds().get("writer", 0.0))
            profile = self.profiler.finish(trainer, index)
            stem = self.outputs.stem(world, rank, index)
            own = [t.tile_id for t in plan.own[index]]
            resumed = len(plan.saves[index].resumed) if plan.saves is not None else 0
            write_rank_record(stem, own, asdict(profile), resumed=resumed)
            logger.info(
                "rank %d wrote %s: %d tiles (%d predicted, %d from saved parts), %s, %.1f s",
                rank,
                stem,
                len(own),
                count,
                resumed,
                summary,
                profile.wall_s,
            )
        seconds = time.perf_counter() - self.started
        tiles = sum(len(tiles) for tiles in plan.predicted)
        logger.info(
            "rank %d: %d scene(s), %d tiles, %.1f s (%.2f tiles/s)",
            rank,
            len(self.scenes),
            tiles,
            seconds,
            tiles / max(seconds, 1e-9),
        )
        # also a barrier: the job ends only once every rank has written its files
        profiles = gather_to_all(trainer, asdict(self.profiler.finish(trainer)))
        if trainer.is_global_zero:
            title = f"predict profile, shard {self.outputs.shard}"
            logger.info("%s", format_profile_table(summarize(profiles), title=title))
            if self.resume_dir is not None:
                remove_resume_dir(self.resume_dir)


class PredictionDataModule(L.LightningDataModule):
    """This rank's share of the shard's tiles (known only once the ranks exist), batch by batch on the rank's stage
    clock: the wait for a batch, then its copy to the device.

    A rank may get no tile at all (more ranks than tiles): it still writes its (empty) rank file.
    """

    def __init__(
        self, dataset_for_rank: Any, batch_size: int, workers: int, pin_memory: bool, clock: StageClock
    ) -> None:
        super().__init__()
        self.dataset_for_rank, self.batch_size, self.workers, self.pin_memory = (
            dataset_for_rank,
            batch_size,
            workers,
            pin_memory,
        )
        self.clock = clock

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.clock.lap("wait")
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.clock.lap("h2d")
        return batch

    def predict_dataloader(self) -> DataLoader:
        trainer = attached_trainer(self)
        dataset = self.dataset_for_rank(trainer.world_size, trainer.global_rank, trainer.strategy.root_device)
        return DataLoader(
            dataset,
            batch_sampler=dataset.batches(self.batch_size),
            num_workers=self.workers if len(dataset) else 0,
            prefetch_factor=prefetch_factor(self.workers if len(dataset) else 0),
            collate_fn=collate_tiles,
            pin_memory=self.pin_memory,
            worker_init_fn=functools.partial(bind_worker, rank_pid=os.getpid()),
        )


def log_job(
    logger: logging.Logger,
    scenes: Sequence[PredictScene],
    shards: int,
    shard: int,
    layout: RankLayout,
    strategy: str,
    batch_size: int,
    workers: int,
) -> None:
    """Rank 0's line of what the job predicts, and how (``strategy``, ``batch_size`` and ``workers``: the
    ``predict`` section's)."""
    logger.info(
        "predicting %d scene(s) (%s): %d tiles, shard %d/%d, %s, strategy %s, batch %d per device, "
        "%d worker(s) per rank",
        len(scenes),
        ", ".join(scene.name for scene in scenes[:5]) + (", ..." if len(scenes) > 5 else ""),
        sum(len(scene.tiles) for scene in scenes),
        shard + 1,
        shards,
        layout,
        strategy,
        batch_size,
        workers,
    )


def run_prediction(
    scenes: Sequence[Scene],
    model_file: str | Path,
    settings: Settings,
    layout: RankLayout,
    out_dir: str | Path,
    log_dir: str | Path,
    shards: int = 1,
    shard: int = 0,
    resume_dir: str | Path | None = None,
) -> None:
    """Predict one shard of a batch of scenes with one model load and one ``trainer.predict`` per rank.
    ``settings``: the job's ``task``, ``model``, ``tiling`` and ``predict`` settings (every ``model.*`` key set
    overrides the model file's). ``resume_dir``: where the ranks save finished tiles and a rerun resumes
    from (none: nothing saved)."""
    predict = settings.predict
    logger = start_rank(layout, log_dir, LOGGER_NAME)
    limit_read_cache(predict.read_cache_mb)
    task = task_spec(settings.task).load()
    model, model_cfg = task.load_model(model_file, settings)
    model = task.prepare_for_inference(model, predict)
    loaded = [load_scene(job) for job in scenes]
    strategy = predict.strategy
    workers = loader_workers(strategy, rank_workers(predict.workers, layout.accelerator, layout.devices))
    resume = (resume_dir, file_digest(model_file)) if resume_dir is not None else None
    plans = RankPlans(task, loaded, settings, shards, shard, resume, logger)
    profiler = PredictProfiler(strategy, predict.batch_size, workers, shard)
    outputs = RankOutputs(task, loaded, plans, out_dir, shard, model_cfg, settings)
    writer = RankWriter(loaded, outputs, profiler, resume_dir, predict.save_every)
    trainer = make_trainer(
        layout,
        logger=False,
        callbacks=[profiler, writer],
        use_distributed_sampler=False,
        benchmark=layout.accelerator == "gpu",  # all tiles have one size: let cuDNN pick its fastest kernels
    )
    if trainer.is_global_zero:
        logger.info("model %s: %s", model_file, task.describe(model_cfg))
        log_job(logger, loaded, shards, shard, layout, strategy, predict.batch_size, workers)
    datamodule = PredictionDataModule(
        lambda world, rank, device: rank_dataset(loaded, plans(world, rank).predicted, strategy, device),
        predict.batch_size,
        workers,
        pin_memory=layout.accelerator == "gpu" and strategy != "batch",
        clock=profiler.clock,
    )
    module = PredictionModule(task, model, profiler.clock)
    trainer.predict(module, datamodule=datamodule, return_predictions=False)
    writer.write(trainer)
    end_rank()
