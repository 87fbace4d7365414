"""Tile-level resume of prediction: a rank saves its finished tiles in the job's resume folder, and a rerun of
a killed job predicts only the rest and gives the same layer as an uninterrupted run.

Library level (no snakemake): the segmentation blender resumed from its parts at several points, detection's rank
output assembled from parts, a fingerprint mismatch. Workflow level, per task: a real 2-rank prediction job
SIGKILLed once its saved parts hold some tiles, rerun, and compared with an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import geopandas as gpd
import numpy as np
import psutil
import pytest
import rasterio
import torch
from affine import Affine

from conftest import UTM17N, report, write_raster
from rasterscale.grid.manifest import tile_grid
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.jobs.paths import RunPaths, resume_dir
from rasterscale.jobs.resume import RankSaves, file_digest, prediction_fingerprint
from rasterscale.settings import job_settings, settings_of
from rasterscale.tasks.segmentation.blend import TileBlender, halo_tiles, tile_cores
from rasterscale.tasks.spec import Part
from segmentation_tiles import NUM_CLASSES, class_map, tile_probabilities
from workflow import rank_stems, run_workflow, tiny_config, workflow_command

TRANSFORM = Affine(0.5, 0, 404000.0, 0, -0.5, 3285000.0)
PRINT = {"config": "a", "model file": "b", "world size": 2, "shards": [1, 0], "tiles": "c"}
LOGGER = logging.getLogger("rasterscale.predict")
RUN = RunPaths("model")  # the run of scene_config's model.file model.pt (no model.name: the file's stem)
MERGED = RUN.batch_record("merge", 0)  # the runs' target: the merged layers (no scores, quicklooks or report pages)


# --- library level --------------------------------------------------------------------------------------------


def blend(tiles, own, cores, truth, path, parts=(), stop=None, saves=None, block_rows=16):
    """Blend a rank's tiles (saving a part after every tile when ``saves``); stop after ``stop`` tiles as a
    killed rank would (its raster never written). The tiles it predicted."""
    height, width = truth.shape
    done = {tile for part in parts for tile in part.tiles}
    todo = halo_tiles(tiles, [i for i in own if i not in done], cores)
    blender = TileBlender(
        todo, own, cores, width, height, NUM_CLASSES, 32, path, TRANSFORM, UTM17N, True, block_rows,
        parts=[p.path for p in parts], keep_unsaved=saves is not None,
    )  # fmt: skip
    for count, tile in enumerate(todo):
        if count == stop:
            blender.__exit__(KeyboardInterrupt)  # what a kill leaves: no rank raster
            return todo
        blender.add(tile.tile_id, tile_probabilities(tile, truth))
        if saves is not None:
            path = saves.next_part_path()
            written = blender.save_part(path)
            if written is not None:
                saves.commit(Part(path, written[0], {"blocks": written[1]}))
    assert blender.close() == sorted(own)
    return todo


@pytest.mark.parametrize("fraction", [0.1, 0.35, 0.8, 0.97])
def test_blender_resumed_from_its_parts_writes_the_same_raster_predicting_only_what_unfinished_cores_need(
    tmp_path, fraction
):
    width, height = 420, 900
    tiles = [Tile(k, *map(int, row)) for k, row in enumerate(tile_grid(width, height, 128, 32))]
    tiles = [t for t in tiles if t.tile_id != 13]  # a tile left out: rows of no core inside the window
    cores, truth = tile_cores(tiles, width, height), class_map(width, height)
    own = {t.tile_id for t in tiles[2:-3]}
    reference = blend(tiles, own, cores, truth, tmp_path / "reference.tif")
    stop = int(fraction * len(reference))
    ranked = RankSaves(tmp_path / "resume", "scene", 0, ".tif", PRINT)
    blend(tiles, own, cores, truth, tmp_path / "rank.tif", stop=stop, saves=ranked)
    assert not (tmp_path / "rank.tif").exists()
    again = RankSaves(tmp_path / "resume", "scene", 0, ".tif", PRINT)
    parts = again.load(LOGGER)
    done = len(again.done)
    assert again.done == ranked.done and len(parts) == len(ranked.parts)
    rest = blend(tiles, own, cores, truth, tmp_path / "rank.tif", parts=parts, saves=again)
    with rasterio.open(tmp_path / "reference.tif") as a, rasterio.open(tmp_path / "rank.tif") as b:
        assert np.array_equal(a.read(), b.read()) and a.profile == b.profile
    assert stop + len(rest) >= len(reference)  # what the parts did not hold is predicted again
    assert again.done == own  # the rerun's parts complete the first's
    if done >= 2 * 5:  # two rows of cores: the first row of tiles fed finished cores only
        assert len(rest) <= len(reference) - 5
    report(
        f"resume (blender): stopped after {stop} of {len(reference)} tiles, {done} own tiles in "
        f"{len(parts)} parts; the rerun predicted {len(rest)}; raster identical"
    )


def test_a_fingerprint_of_another_world_size_starts_over_with_one_line(tmp_path, caplog):
    first = RankSaves(tmp_path, "scene", 1, ".parquet", PRINT)
    part = first.next_part_path()
    part.parent.mkdir(parents=True)
    part.write_bytes(b"boxes")
    first.commit(Part(part, [4, 5]))
    other = RankSaves(tmp_path, "scene", 1, ".parquet", {**PRINT, "world size": 3})
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert other.load(LOGGER) == [] and other.done == set()
    assert [r.getMessage() for r in caplog.records] == [
        f"resume: {first.index_path} made with another world size; starting over"
    ]
    assert not part.exists() and not first.index_path.exists()
    same = RankSaves(tmp_path, "scene", 1, ".parquet", PRINT)
    assert same.load(LOGGER) == []  # nothing left to resume


def test_fingerprint_ignores_the_save_interval_only():
    config = {"task": "detection", "predict": {"batch_size": 2, "save_every": 60}}
    settings = job_settings(config)
    base = prediction_fingerprint(settings, "m", 2, 1, 0, [0, 1, 2])
    resaved = job_settings({**config, "predict": {"batch_size": 2, "save_every": 5}})
    assert prediction_fingerprint(resaved, "m", 2, 1, 0, [0, 1, 2]) == base
    other = job_settings({**config, "predict": {"batch_size": 3}})
    assert prediction_fingerprint(other, "m", 2, 1, 0, [0, 1, 2]) != base
    assert (
        prediction_fingerprint(settings, "m", 2, 1, 0, [0, 1]) != base
        and prediction_fingerprint(settings, "n", 2, 1, 0, [0, 1, 2]) != base
    )
    assert resume_dir("results/m/predict/batch-0/shard-1") == "results/m/predict/batch-0/shard-1.resume"


def test_detection_rank_output_from_parts_equals_one_written_at_once(tmp_path):
    from rasterscale.tasks.api import PredictScene
    from rasterscale.tasks.detection.rankoutput import DetectionRankOutput, TileDetections

    tiles = [Tile(k, 100 * k, 0, 128, 128) for k in range(7)]
    scene = PredictScene("scene", "scene.tif", tiles, None, TileGrid(128, 28), 800, 128, TRANSFORM, UTM17N)
    rng = np.random.default_rng(0)

    def result(tile):
        n = int(tile.tile_id % 3) * 4  # some tiles without boxes
        xy = rng.uniform(0, 100, size=(n, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(5, 28, size=(n, 2))], axis=1).astype(np.float32)
        return TileDetections(boxes, rng.uniform(0, 1, n).astype(np.float32), rng.integers(0, 2, n))

    results = [(tile, result(tile)) for tile in tiles]
    whole = DetectionRankOutput(scene, ["tree", "shrub"], tmp_path / "whole.parquet")
    for tile, r in results:
        whole.add(tile, r)
    whole.write()
    saves = RankSaves(tmp_path / "resume", "scene", 0, ".parquet", PRINT)
    first = DetectionRankOutput(scene, ["tree", "shrub"], tmp_path / "never.parquet", [])
    for tile, r in results[:4]:  # tiles 0..3 saved in two parts, then the rank dies
        first.add(tile, r)
        if tile.tile_id % 2:
            saves.commit(first.save_part(saves.next_part_path()))
    assert first.save_part(saves.next_part_path()) is None  # nothing new
    parts = RankSaves(tmp_path / "resume", "scene", 0, ".parquet", PRINT).load(LOGGER)
    assert [p.tiles for p in parts] == [[0, 1], [2, 3]]
    resumed = DetectionRankOutput(scene, ["tree", "shrub"], tmp_path / "resumed.parquet", parts)
    for tile, r in results[4:]:
        resumed.add(tile, r)
    resumed.write()
    a, b = gpd.read_parquet(tmp_path / "whole.parquet"), gpd.read_parquet(tmp_path / "resumed.parquet")
    assert len(a) > 10 and a.equals(b) and a.crs == b.crs


# --- workflow level -------------------------------------------------------------------------------------------


def done_tiles(folder: Path) -> int:
    """Own tiles the ranks' resume indexes vouch for (an index is rewritten atomically)."""
    total = 0
    for index in folder.glob("*/rank-*.index.json"):
        total += sum(len(p["tiles"]) for p in json.loads(index.read_text())["parts"])
    return total


def kill_job_once_saved(workdir: Path, config: dict, min_done: int) -> tuple[int, float]:
    """Start the workflow, SIGKILL its prediction ranks once their saved parts hold ``min_done`` tiles (polling
    the resume folder), and wait for snakemake to fail; the tiles saved and the seconds it took to end."""
    folder = workdir / RUN.shard_resume_dir(0, 0)
    process = subprocess.Popen(
        workflow_command(workdir, config, "--cores", "2", MERGED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 240
    while done_tiles(folder) < min_done:
        assert process.poll() is None, "the workflow ended before its saved parts held enough tiles"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    done = done_tiles(folder)
    ranks = [p for p in psutil.Process(process.pid).children(recursive=True) if "predict.py" in " ".join(p.cmdline())]
    assert ranks
    killed = time.monotonic()
    for rank in ranks:
        os.kill(rank.pid, signal.SIGKILL)
    output = process.communicate(timeout=120)[0].decode()
    assert process.returncode != 0, output[-3000:]
    assert not (workdir / RUN.shard_dir(0, 0)).exists()  # snakemake removed the failed output
    return done, time.monotonic() - killed


def predicted_tiles(workdir: Path, scene: str, suffix: str) -> tuple[int, int]:
    """(tiles predicted, tiles taken from saved parts) by the last run, from the rank records."""
    records = [
        json.loads(stem.with_suffix(".json").read_text()) for stem in rank_stems(workdir / RUN.root, scene, suffix)
    ]
    return sum(r["profile"]["tiles"] for r in records), sum(r["resumed"] for r in records)


def uninterrupted(workdir: Path, config: dict, out: Path) -> dict[str, str]:
    """The uninterrupted reference, in this process: the same prediction job over ``workdir``'s scene (as 2
    shards of 1 rank: the same tiles per rank file, each rank on one thread as the workflow's 2 ranks on 2
    cores), its rank records checked and its rank files merged by the task's merge; the merged files."""
    from rasterscale.config.schema import validate_config
    from rasterscale.grid.manifest import read_manifest
    from rasterscale.jobs.files import PredictJob
    from rasterscale.jobs.rankfiles import check_scene_records
    from rasterscale.predict.engine import run_prediction
    from rasterscale.runtime.ranks import rank_layout
    from rasterscale.tasks.registry import task_spec

    cwd, affinity = Path.cwd(), os.sched_getaffinity(0)
    os.chdir(workdir)
    os.sched_setaffinity(0, {min(affinity)})
    try:
        valid = validate_config(config)
        settings = settings_of(valid)
        predict = {**{k: v for k, v in valid["predict"].items() if k != "scenes"}, "devices": 1, "shards": 2}
        job = job_settings(
            {"task": valid["task"], "model": valid["model"], "tiling": valid["tiling"], "predict": predict}
        )
        for shard in (0, 1):
            scenes = list(PredictJob.read(RUN.job_file("predict", 0)).scenes)
            run_prediction(scenes, settings.model.file, job, rank_layout(job, "predict"), out, out / "logs", 2, shard)
        spec = task_spec(settings.task)
        (scene,) = PredictJob.read(RUN.job_file("predict", 0)).scenes
        stems = [str(out / scene.name / f"rank-{i}") for i in (0, 1)]
        check_scene_records(stems, read_manifest(scene.manifest)["tile_id"].to_numpy())
        merged = {key: str(out / Path(scene.outputs[key]).name) for key in spec.scene_outputs(settings)}
        # a merge job's sections, and the cog section its rule's threads make (scripts/merge.py)
        merge = job_settings({"task": valid["task"], "merge": valid["merge"], "predict": predict, "cog": valid["cog"]})
        into = dataclasses.replace(scene, outputs={**scene.outputs, **merged})
        spec.merge(into, [stem + spec.rank_suffix for stem in stems], merge, spec.labels(settings))
        return merged
    finally:
        os.sched_setaffinity(0, affinity)
        os.chdir(cwd)


def resume_case(tmp_path: Path, config: dict, scene: str, suffix: str, min_done: int) -> dict:
    """A killed run then its rerun, and the uninterrupted reference (:func:`uninterrupted`); what was measured."""
    resumed = tmp_path / "resumed"
    t0 = time.monotonic()
    done, seconds = kill_job_once_saved(resumed, config, min_done)
    t1 = time.monotonic()
    run_workflow(resumed, config, MERGED)  # the same command again
    t2 = time.monotonic()
    log = (resumed / "logs/predict/batch-0/shard-0.log").read_text()
    assert "resuming: " in log and f"tiles already done in {RUN.shard_resume_dir(0, 0)}" in log
    assert not (resumed / RUN.shard_resume_dir(0, 0)).exists()  # removed on success
    rerun, from_saved = predicted_tiles(resumed, scene, suffix)
    reference = uninterrupted(resumed, config, tmp_path / "plain")
    full = sum(json.loads(p.read_text())["profile"]["tiles"] for p in (tmp_path / "plain" / scene).glob("*.json"))
    assert from_saved >= done and rerun < full
    timing = f"killed run {t1 - t0:.0f} s, rerun {t2 - t1:.0f} s"
    return {"done": done, "kill_s": seconds, "rerun": rerun, "full": full, "resumed": resumed, "plain": reference,
            "timing": timing}  # fmt: skip


def untrained_model(path: Path, task: str) -> str:
    torch.manual_seed(0)
    if task == "detection":
        from rasterscale.tasks.detection.model import DetectorConfig, build_detector, save_detector

        detector = DetectorConfig(backbone="resnet18", patch_size=256, score_threshold=0.0)
        save_detector(build_detector(detector), detector, path)
    else:
        from rasterscale.tasks.segmentation.model import build_segmenter, save_segmenter
        from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig

        segmenter = SegmenterConfig(labels=("background", "tree"), patch_size=256)
        save_segmenter(build_segmenter(segmenter), segmenter, path)
    return str(path)


PREDICT = {"devices": 2, "batch_size": 1, "workers": 0, "save_every": 0}


def scene_config(tmp_path: Path, task: str, width: int, height: int) -> dict:
    """A 2-rank prediction of one scene (a random RGB raster) with an untrained model, saving a part after
    every batch of one tile."""
    (tmp_path / "resumed").mkdir()
    write_raster(tmp_path / "resumed/scene.tif", width, height)
    config = tiny_config(predict={**PREDICT, "scenes": ["scene"]}, train={"scenes": []})
    config.update(task=task, scenes={"scene": {"path": "scene.tif"}}, demo={"scenes": {}})
    config["model"] = {"file": untrained_model(tmp_path / "model.pt", task)}
    if task == "detection":
        config["model"]["score_threshold"] = 0.0
    return config


def test_detection_job_killed_after_some_tiles_resumes_and_merges_identical_boxes(tmp_path):
    config = scene_config(tmp_path, "detection", 900, 700)  # 20 tiles
    case = resume_case(tmp_path, config, "scene", ".parquet", min_done=4)
    a = gpd.read_parquet(case["resumed"] / RUN.scene_file("scene", "detections.parquet"))
    b = gpd.read_parquet(case["plain"]["parquet"])
    assert len(a) > 100 and a.equals(b)
    report(
        f"resume (detection workflow): killed with {case['done']} tiles saved, job ended "
        f"{case['kill_s']:.1f} s after the kill; rerun predicted {case['rerun']} of {case['full']} tiles; "
        f"{len(a)} merged boxes identical to an uninterrupted run's ({case['timing']})"
    )


def test_segmentation_job_killed_after_some_rows_resumes_and_merges_identical_classes(tmp_path):
    config = scene_config(tmp_path, "segmentation", 300, 1800)  # 2 x 10 tiles: rows of cores finish one by one
    case = resume_case(tmp_path, config, "scene", ".tif", min_done=8)
    with (
        rasterio.open(case["resumed"] / RUN.scene_file("scene", "classes.tif")) as a,
        rasterio.open(case["plain"]["classes"]) as b,
    ):
        classes = a.read(1)
        assert np.array_equal(classes, b.read(1))
    assert len(np.unique(classes)) == 2  # both classes: a real comparison
    report(
        f"resume (segmentation workflow): killed with {case['done']} own tiles saved, job ended "
        f"{case['kill_s']:.1f} s after the kill; rerun predicted {case['rerun']} of {case['full']} tiles; "
        f"classes.tif identical to an uninterrupted run's ({case['timing']})"
    )


def test_model_digest_of_a_file_and_of_a_deepforest_folder_changes_with_any_byte(tmp_path):
    """The fingerprint's model digest reads a .pt file or a model folder (config.json + model.safetensors)."""
    folder = tmp_path / "tree"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_classes": 1}')
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    single = tmp_path / "model.pt"
    single.write_bytes(b"\0" * 1000)
    before_folder, before_file = file_digest(folder), file_digest(single)
    (folder / "model.safetensors").write_bytes(b"\0" * 999 + b"\1")
    single.write_bytes(b"\0" * 999 + b"\1")
    assert file_digest(folder) != before_folder and file_digest(single) != before_file
    assert file_digest(folder) == file_digest(folder) and before_folder != before_file
