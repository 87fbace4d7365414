"""Running out of disk space in the middle of each kind of output, on a real small file system (a tmpfs mounted
here; skipped, with the reason, where none can be mounted): the write stops with one line naming the file and
"no space left on device" (:class:`rasterscale.atomic.DiskFullError`, an input error: no traceback), leaves nothing
where the finished file belongs and no temporary beside it, and once the space is freed the same write gives what
an uninterrupted one gives. The caches (the stored plan, the header cache) are not stored instead, with one warning
line, and nothing stale is left to be read.

Each case fills the file system with a filler file (its size from statvfs) to less than the write needs, writes,
deletes the filler and writes again. Most cases call the package's writers themselves (rank outputs, merges, a
partition, the model files, the stored plan, the header cache); one runs the real workflow (prediction, then its
merge) with results/ on the small file system, and its rerun's layer is the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import torch
from affine import Affine
from safetensors import safe_open

import snakemake_forks
from conftest import UTM17N, write_raster
from rasterscale.atomic import FULL_BELOW, DiskFullError, atomic_path, space_left, write_gpkg
from rasterscale.errors import one_line
from rasterscale.grid.manifest import build_manifest, tiles_from_frame
from rasterscale.grid.tile import Tile
from rasterscale.jobs.files import ProjectJob
from rasterscale.jobs.paths import RunPaths
from rasterscale.raster.cog import conversion_bytes, convert_to_cog
from rasterscale.raster.header_cache import HeaderCache
from rasterscale.raster.headers import read_checked_header
from rasterscale.raster.imagery import resolve_spec
from rasterscale.scene import ProjectSource
from rasterscale.settings import job_settings
from rasterscale.tasks.detection.merge import write_detections_file
from rasterscale.tasks.detection.model import DetectorConfig, build_detector, save_detector
from rasterscale.tasks.detection.modelfiles import write_deepforest_folder
from rasterscale.tasks.detection.rankoutput import TileDetections, detections_frame
from rasterscale.tasks.detectors.project import PROJECT_COLUMNS, write_project
from rasterscale.tasks.modelfiles import save_payload
from rasterscale.tasks.segmentation.blend import TileBlender, tile_cores
from rasterscale.tasks.segmentation.merge import merge_class_rasters
from rasterscale.workflow.checks import build_plan
from rasterscale.workflow.storage import (
    fingerprint,
    load_plan,
    plan_of_batch,
    plan_to_json,
    store_batch_plans,
    store_plan_text,
)
from segmentation_tiles import NUM_CLASSES, class_map, predict_ranks, tile_probabilities
from workflow import run_workflow, tiny_config, workflow_command

MiB = 2**20
FILLER = "filler"
TRANSFORM = Affine(0.5, 0, 404000.0, 0, -0.5, 3285000.0)


# --- a small file system ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmallDisk:
    """A tmpfs mounted at ``root``, filled at will by a filler file."""

    root: Path

    def fill(self, leave: int) -> None:
        """Leave ``leave`` bytes free (fewer by less than a block): a filler file takes the rest."""
        filler = self.root / FILLER
        filler.unlink(missing_ok=True)
        take = space_left(self.root / "probe") - leave
        assert take >= 0, f"{leave} bytes asked, {take + leave} free"
        with filler.open("wb") as handle:
            os.posix_fallocate(handle.fileno(), 0, max(take, 1))
        assert space_left(self.root / "probe") <= leave

    def free(self) -> None:
        (self.root / FILLER).unlink(missing_ok=True)

    def files(self) -> set[str]:
        """Every file and folder under the root (the filler aside)."""
        return {str(path.relative_to(self.root)) for path in self.root.rglob("*") if path.name != FILLER}


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[SmallDisk]:
    """A tmpfs of ``size`` bytes at ``where`` for the block; the test is skipped where none can be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here: {mounted.stderr.decode().strip()}")
    try:
        yield SmallDisk(where)
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path / "disk", 8 * MiB) as mounted:
        yield mounted


def size_of(path: Path) -> int:
    """A file's bytes, or a folder's files'."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def runs_out_of_space(disk: SmallDisk, final: Path, write: Callable[[], object], leave: int) -> DiskFullError:
    """``write`` with ``leave`` bytes free: it stops with a DiskFullError naming ``final`` whose one line says so,
    and leaves the disk as it found it (nothing at ``final``, no temporary). The disk is freed again after."""
    final.parent.mkdir(parents=True, exist_ok=True)  # as the workflow's folders are
    before = disk.files()
    disk.fill(leave)
    try:
        with pytest.raises(DiskFullError) as caught:
            write()
        assert disk.files() == before
    finally:
        disk.free()
    assert caught.value.path == str(final) and not final.exists()
    line = f"rasterscale: {one_line(caught.value)}"  # what run_entry prints (a rank: with its number)
    pattern = rf"rasterscale: {re.escape(str(final))}: no space left on device \(.+ left on .+\); free some space.*"
    assert re.fullmatch(pattern, line), line
    return caught.value


# --- what is written: rank outputs, merged layers, a partition, model files ------------------------------------


def detections(count: int, seed: int = 0) -> gpd.GeoDataFrame:
    """A rank's detections in its file's columns (detection's own frame of tiles' boxes)."""
    rng = np.random.default_rng(seed)
    tiles = []
    for k in range(count // 100):
        xy = rng.uniform(0, 100, size=(100, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(5, 28, size=(100, 2))], axis=1).astype(np.float32)
        result = TileDetections(boxes, rng.uniform(0, 1, 100).astype(np.float32), rng.integers(0, 2, 100))
        tiles.append((Tile(k, 96 * k, 0, 128, 128), result))
    return detections_frame(tiles, ["tree", "shrub"], TRANSFORM, UTM17N)


def project_objects(count: int) -> gpd.GeoDataFrame:
    frame = detections(count)
    owner = np.where(np.arange(len(frame)) % 3 == 0, "b", "a")
    return gpd.GeoDataFrame(frame.assign(scene=owner, source=owner)[PROJECT_COLUMNS], crs=UTM17N)


def write_partition(path: Path, frame: gpd.GeoDataFrame) -> None:
    """A partition of a project layer (its owners' objects, Hilbert-sorted), as a partition's job writes it."""
    sources = (ProjectSource("a"), ProjectSource("b"))
    job = ProjectJob(UTM17N, ("tree",), sources, {"partition": str(path)}, job_settings({"task": "detection"}), ("a",))
    write_project(job, frame, len(frame), "detections", layer="detections")


def random_cog_source(path: Path) -> Path:
    """An incompressible striped raster, its COG about its size; rio_cogeo's intermediate copy, uncompressed in whole
    512 px blocks, is twice that (:func:`rasterscale.raster.cog.conversion_bytes`)."""
    return write_raster(path, 700, 600, tiled=False)


@dataclass(frozen=True)
class Output:
    """A kind of output: its file name, how it is written at a path, and what of it two writes must share."""

    name: str
    write: Callable[[Path], object]
    read: Callable[[Path], object]
    leave: Callable[[int], int] = lambda need: need // 2  # the bytes left free, of its size


def read_bytes(path: Path) -> bytes:
    return path.read_bytes()


def read_frame(path: Path) -> dict:
    """A layer's rows (geometries as WKT), its columns and its CRS."""
    frame = gpd.read_file(path)
    return {"crs": frame.crs.to_wkt(), **frame.to_wkt().to_dict(orient="split")}


def read_model(path: Path) -> dict:
    payload = torch.load(path, weights_only=True)
    return {**payload, "state_dict": {k: v.tolist() for k, v in payload["state_dict"].items()}}


def read_folder(path: Path) -> dict:
    """A DeepForest folder's config.json, and its weights with their metadata (safetensors writes the metadata in
    no fixed order)."""
    with safe_open(path / "model.safetensors", "pt") as weights:
        tensors = {key: weights.get_tensor(key).tolist() for key in weights.keys()}  # noqa: SIM118
        metadata = weights.metadata()
    return {"files": sorted(p.name for p in path.iterdir()), "config": (path / "config.json").read_text(),
            "tensors": tensors, "metadata": metadata}  # fmt: skip


KINDS = (
    "rank parquet",
    "merged GeoPackage",
    "partition",
    "COG, its intermediate copy short",
    "COG, the COG itself short",
    "model file",
    "DeepForest folder",
)


def output_kinds(sources: Path) -> dict[str, Output]:
    frame, objects = detections(12_000), project_objects(12_000)
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 768)
    detector = DetectorConfig(backbone="resnet18", patch_size=128)
    weights = {"head.weight": torch.randn(600, 1024), "head.bias": torch.randn(600)}
    cog_source = random_cog_source(sources / "striped.tif")
    return {
        "rank parquet": Output("rank-0.parquet", lambda p: write_detections_file(frame, p), read_bytes),
        "merged GeoPackage": Output("detections.gpkg", lambda p: write_gpkg(frame, p, "detections"), read_frame),
        "partition": Output("partition-0.parquet", lambda p: write_partition(p, objects), read_bytes),
        "COG, its intermediate copy short": Output("cog.tif", lambda p: convert_to_cog(cog_source, p), read_bytes),
        "COG, the COG itself short": Output(
            "cog.tif",
            lambda p: convert_to_cog(cog_source, p),
            read_bytes,
            leave=lambda need: conversion_bytes(cog_source) // 2 + need // 2,  # the intermediate copy fits
        ),
        "model file": Output("model.pt", lambda p: save_payload(p, "test-model/1", {"n": 1}, linear), read_model),
        "DeepForest folder": Output("model", lambda p: write_deepforest_folder(weights, detector, p), read_folder),
    }


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Output]:
    return output_kinds(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_short_of_space_stops_with_one_line_leaves_nothing_and_a_rewrite_is_whole(kinds, kind, disk, tmp_path):
    output = kinds[kind]
    reference = tmp_path / "reference" / output.name
    output.write(reference)
    need = size_of(reference)
    final = disk.root / "out" / output.name
    runs_out_of_space(disk, final, lambda: output.write(final), output.leave(need))
    output.write(final)
    assert output.read(final) == output.read(reference)


# --- a rank's raster and a segmentation merge -------------------------------------------------------------------

PATCH, OVERLAP, LABELS = 128, 32, ["background", "disc", "rectangle"]


@dataclass(frozen=True)
class Segmented:
    """A scene, its tiles and class map, and its rank raster (one rank: classes and noisy probabilities, hardly
    compressible) as an uninterrupted blend writes it."""

    raster: Path
    tiles: list[Tile]
    truth: np.ndarray
    rank_raster: Path

    def blend(self, out_dir: Path) -> Path:
        """The rank raster blended into ``out_dir`` (waiting chunks sent to disk beside it on the way)."""
        with rasterio.open(self.raster) as src:
            transform, crs = src.transform, src.crs
        (path,) = predict_ranks(
            self.tiles, self.truth, OVERLAP, out_dir, 1, transform, crs, probabilities=True, blend_mb=0
        )
        return path

    def save_part(self, out_dir: Path, part: Path) -> None:
        """What a rank that saves its finished tiles does: the blocks of the first half of the tiles saved as a
        part at ``part`` (the rank raster, in ``out_dir``, is not finished here)."""
        height, width = self.truth.shape
        with rasterio.open(self.raster) as src:
            transform, crs = src.transform, src.crs
        cores, own = tile_cores(self.tiles, width, height), [t.tile_id for t in self.tiles]
        blender = TileBlender(
            self.tiles, own, cores, width, height, NUM_CLASSES, OVERLAP, out_dir / "rank-0.tif", transform, crs,
            probabilities=True, keep_unsaved=True,
        )  # fmt: skip
        for tile in self.tiles[: len(self.tiles) // 2]:
            blender.add(tile.tile_id, tile_probabilities(tile, self.truth))
        assert blender.save_part(part) is not None  # a failure here: the blender's own to clean up
        blender.__exit__(KeyboardInterrupt)  # the rank stops here: no rank raster

    def merge(self, classes: Path) -> dict:
        return merge_class_rasters([self.rank_raster], self.raster, resolve_spec(self.raster), classes, None, LABELS)


def scratch_bytes(path: Path, block: int = 512) -> int:
    """The bytes of a merge's scratch raster of a layer like ``path`` (its size and bands, one byte a pixel):
    uncompressed, in whole ``block`` px blocks, without overviews."""
    with rasterio.open(path) as src:
        return -(-src.width // block) * -(-src.height // block) * block * block * src.count


@pytest.fixture(scope="module")
def segmented(tmp_path_factory) -> Segmented:
    folder = tmp_path_factory.mktemp("segmented")
    width, height = 1100, 700
    raster = write_raster(folder / "scene.tif", width, height)
    tiles = tiles_from_frame(build_manifest(raster, PATCH, OVERLAP))
    scene = Segmented(raster, tiles, class_map(width, height, seed=3), folder / "ranks" / "rank-0.tif")
    (folder / "ranks").mkdir()
    assert scene.blend(folder / "ranks") == scene.rank_raster
    return scene


def test_a_rank_raster_short_of_space_stops_with_one_line_leaves_no_temporary_and_reblends_the_same(segmented, disk):
    need = size_of(segmented.rank_raster)
    shard = disk.root / "shard-0"
    shard.mkdir()
    runs_out_of_space(disk, shard / "rank-0.tif", lambda: segmented.blend(shard), need // 2)
    assert segmented.blend(shard).read_bytes() == segmented.rank_raster.read_bytes()


def test_a_rank_part_short_of_space_stops_with_one_line_leaves_no_temporary_and_is_saved_the_same_after(
    segmented, disk, tmp_path
):
    reference = tmp_path / "reference.resume" / "part-0.tif"
    segmented.save_part(tmp_path, reference)
    part = disk.root / "shard-0.resume" / "scene" / "part-0.tif"
    runs_out_of_space(disk, part, lambda: segmented.save_part(tmp_path, part), size_of(reference) // 2)
    assert not list(tmp_path.glob(".rank-0*"))  # the rank raster's temporary and spilled pieces: removed too
    segmented.save_part(tmp_path, part)
    assert part.read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("short", ["assembling", "converting"])
def test_a_segmentation_merge_short_of_space_stops_with_one_line_and_merges_the_same_after(
    segmented, disk, tmp_path, short
):
    reference = tmp_path / "reference" / "classes.tif"
    summary = segmented.merge(reference)
    assembly = scratch_bytes(reference)  # the scratch raster, uncompressed, before its overviews
    slack = FULL_BELOW + FULL_BELOW // 2  # what is left once it is written: above a full disk
    assert conversion_bytes(reference) // 2 - assembly > slack  # its overviews need more
    classes = disk.root / "scene" / "classes.tif"
    # the scratch raster short; or the scratch raster whole, its overviews and the COG short
    leave = assembly // 2 if short == "assembling" else assembly + slack
    runs_out_of_space(disk, classes, lambda: segmented.merge(classes), leave)
    assert segmented.merge(classes) == summary
    assert classes.read_bytes() == reference.read_bytes()


# --- the caches: the stored plan, the header cache -------------------------------------------------------------


def scenes_config(folder: Path, count: int) -> dict:
    """``count`` tiny scenes side by side, 4 a batch, the first trained on."""
    for k in range(count):
        write_raster(folder / f"s{k}.tif", 64, 64, transform=Affine(0.1, 0, 404000.0 + 10 * k, 0, -0.1, 3285000.0))
    (folder / "s0.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\ns0.tif,10,10,50,50,tree\n")
    scenes = {f"s{k}": {"path": str(folder / f"s{k}.tif")} for k in range(count)}
    scenes["s0"]["annotations"] = str(folder / "s0.csv")
    return {
        "scenes": scenes,
        "tiling": {"patch_size": 32, "overlap": 0},
        "train": {"scenes": ["s0"], "validation_fraction": 0},
        "predict": {"scenes": "all", "scenes_per_job": 4},
    }


def test_the_stored_plan_short_of_space_is_not_stored_with_one_warning_and_no_stale_plan_is_left(disk, tmp_path):
    config = scenes_config(tmp_path, 24)
    plan = build_plan(config, disk.root)
    older = build_plan({**config, "tiling": {"patch_size": 64, "overlap": 0}}, disk.root)  # stored by older code
    key, batches = fingerprint(config), sorted(plan.batch_numbers)
    stored = store_plan_text(plan_to_json(older), key, disk.root)
    store_batch_plans(older, key, disk.root)
    assert stored is not None and load_plan(key, disk.root) == older and plan != older and len(batches) == 6
    whole, each = plan_to_json(plan), len(plan_to_json(plan_of_batch(plan, batches[0])))
    before = disk.files()
    warnings: list[str] = []
    disk.fill(len(whole) // 2)
    try:  # the main process stores its plan
        assert store_plan_text(whole, key, disk.root, warnings.append) is None
    finally:
        disk.free()
    assert not stored.exists() and not stored.with_suffix("").exists()  # the older plan's, batch plans too
    assert disk.files() == {name for name in before if "/plan-" not in name}  # nor a temporary
    store_batch_plans(older, key, disk.root)  # older batch plans back: the ones to replace
    disk.fill(each // 2)
    try:  # then, at onstart, the batch plans
        store_batch_plans(plan, key, disk.root, warnings.append)
    finally:
        disk.free()
    assert [line.split(": no space left on device (")[0] for line in warnings] == [
        str(stored),
        str(stored.with_suffix("") / f"batch-{batches[0]}.json"),
    ]
    assert all(re.fullmatch(r"\S+: no space left on device \(.+\); not stored, .*", line) for line in warnings)
    assert load_plan(key, disk.root) is None  # no plan: a job builds its own
    assert [load_plan(key, disk.root, b) for b in batches] == [None] * 6  # the older ones removed, none stale
    assert not [p for p in disk.root.rglob("*") if ".tmp-" in p.name]
    # space freed: stored as always
    assert store_plan_text(whole, key, disk.root) == stored and load_plan(key, disk.root) == plan
    store_batch_plans(plan, key, disk.root)
    assert [load_plan(key, disk.root, b) for b in batches] == [plan_of_batch(plan, b) for b in batches]


def test_the_header_cache_short_of_space_is_removed_with_one_warning_and_made_again_after(disk, tmp_path):
    raster = write_raster(tmp_path / "scene.tif", 64, 64)
    checked = read_checked_header(str(raster))
    file = disk.root / ".snakemake" / "rasterscale" / "headers.sqlite"
    versions = {f"{tmp_path}/scenes/{k:05d}/scene.tif": f"{k}:{k * 7}" for k in range(400)}
    warnings: list[str] = []
    cache = HeaderCache.open(file, warnings.append)
    assert cache is not None
    disk.fill(8192)  # less than the entries take
    try:
        for path, version in versions.items():
            cache.put(path, version, checked)
        cache.close()
    finally:
        disk.free()
    assert warnings == [f"{file}: no space left on device; the header cache is removed, and made again by the next run"]
    assert not list(file.parent.iterdir())  # nor its journal
    again = HeaderCache.open(file, warnings.append)
    assert again is not None
    for path, version in versions.items():
        again.put(path, version, checked)
    again.close()
    kept = HeaderCache.open(file, warnings.append)
    assert kept is not None and len(warnings) == 1
    assert all(
        kept.get(path, version) == (replace(checked[0], path=path), checked[1]) for path, version in versions.items()
    )
    kept.close()


def test_a_write_that_fails_for_another_reason_is_not_called_out_of_space(disk):
    with pytest.raises(ValueError, match="not a disk error"), atomic_path(disk.root / "x.json") as tmp:
        tmp.write_text("{}")
        raise ValueError("not a disk error")
    assert not disk.files()


# --- the workflow: a prediction and a merge short of space, each rerun ------------------------------------------

SCENE = "scene"
RUN = RunPaths("model")
MERGED = RUN.batch_record("merge", 0)


def short_run(results: SmallDisk, workdir: Path, config: dict, target: str, leave: int) -> str:
    """The workflow towards ``target`` with ``leave`` bytes free on ``results``: it fails, and adds no file there but
    whole ones (``target``'s, or no temporary); the disk is freed again after. Snakemake's output."""
    before = results.files()
    results.fill(leave)
    try:
        failed = snakemake_forks.run(workflow_command(workdir, config, "--cores", "2", target), timeout=300)
        assert failed.returncode != 0, failed.stderr[-3000:]
        added = results.files() - before
    finally:
        results.free()
    assert not [name for name in added if ".tmp-" in name or ".spill-" in name], added
    return failed.stderr


def one_error_line(log: Path) -> str:
    """The one line of a job's log that says what stopped it; no traceback there."""
    text = log.read_text()
    lines = [line for line in text.splitlines() if "no space left" in line or "Error" in line or "Traceback" in line]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_workflow_short_of_space_stops_with_one_line_and_each_plain_rerun_gives_the_uninterrupted_layer(tmp_path):
    """Prediction with results/ on a small disk: its rank's file short of space, then its merge's GeoPackage."""
    workdir = tmp_path / "run"
    with small_disk(workdir / "results", 24 * MiB) as results:
        write_raster(workdir / "scene.tif", 400, 300)  # 12 tiles
        torch.manual_seed(0)
        model = DetectorConfig(backbone="resnet18", patch_size=128, score_threshold=0.0)  # untrained: many boxes
        save_detector(build_detector(model), model, workdir / "model.pt")
        config = tiny_config(
            predict={"scenes": [SCENE], "devices": 1, "batch_size": 4, "workers": 0}, train={"scenes": []}
        )
        config.update(scenes={SCENE: {"path": "scene.tif"}}, demo={"scenes": {}})
        config["model"] = {"file": "model.pt", "score_threshold": 0.0}
        config["tiling"] = {"patch_size": 128, "overlap": 32}
        run_workflow(workdir, config, MERGED)  # uninterrupted
        layers = [workdir / RUN.scene_file(SCENE, name) for name in ("detections.parquet", "detections.gpkg")]
        reference = [gpd.read_parquet(layers[0]), read_frame(layers[1])]
        shard = workdir / RUN.shard_dir(0, 0)
        rank_file = shard / SCENE / "rank-0.parquet"
        merged = [workdir / MERGED, *(workdir / p for p in json.loads((workdir / MERGED).read_text())["outputs"])]
        need = {path: size_of(path) for path in (rank_file, *merged)}
        rank_rows = gpd.read_parquet(rank_file)

        # the rank's file short of space: the rank's one line, the job's folder gone; a plain rerun predicts it
        shutil.rmtree(shard)
        for path in merged:
            path.unlink()
        short_run(results, workdir, config, RUN.shard_dir(0, 0), need[rank_file] // 2)
        line = one_error_line(workdir / "logs/predict/batch-0/shard-0.log")
        assert line.startswith(f"rasterscale: rank 0: {RUN.shard_dir(0, 0)}/{SCENE}/rank-0.parquet: no space left")
        assert not shard.exists()
        run_workflow(workdir, config, RUN.shard_dir(0, 0))
        assert gpd.read_parquet(rank_file).equals(rank_rows)

        # the merge's GeoPackage short of space: its one line, no GeoPackage; a plain rerun merges it
        short_run(results, workdir, config, MERGED, need[layers[0]] + 4096 + need[layers[1]] // 2)
        line = one_error_line(workdir / "logs/merge/batch-0.log")
        assert line.startswith(f"rasterscale: {RUN.scene_file(SCENE, 'detections.gpkg')}: no space left on device (")
        assert (workdir / "logs/merge/batch-0.log").read_text() == line + "\n"  # the whole log
        assert not layers[1].exists()
        run_workflow(workdir, config, MERGED)
        assert gpd.read_parquet(layers[0]).equals(reference[0]) and read_frame(layers[1]) == reference[1]
