"""Memory at scale of the tasks that blend rasters (segmentation, regression): peak RSS of a prediction rank and of
the merge on rasters of 4k to 32k a side.

Each raster gets the manifest of a band of full-width tile rows across its middle, as many rows as make about
:data:`TILES` tiles (the whole 4k raster, 4 rows of the 16k one, 2 of the 32k one): every rank does the same work,
so what differs is the raster's size, and on the widest the blend's pieces wait for the row of tiles below across
32k px (they wait on disk, and the rank raster is written block by block). The rank runs :data:`RUNS` times per
raster and the median peak is the figure: the peak varies from run to run with the allocator, by up to 70 MB on
the same raster, and one run in ten or so is 100 MB above the others (segmentation, 4 runs each: 1125-1192 MB on
4k, 1130-1148 MB on 32k; the highest of 2 runs once made 32k look 8% above 4k).
The merge then writes the task's scene outputs of the whole raster block by block: segmentation's classes.tif and
probabilities.tif COGs and classes.gpkg, regression's values.tif float32 COG. The model is an untrained network,
seeded (:data:`DENSE_TASKS`): the rank's memory does not depend on its weights, but segmentation's merge's does,
through classes.gpkg: an untrained model's noisy class map is a worst case of many polygons and one region with
thousands of holes across the band.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs import run_predict_job
from rasterscale.config.schema import validate_config
from rasterscale.grid.manifest import manifest_frame, tile_grid, tiles_from_frame, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.jobs.files import MergeJob
from rasterscale.jobs.paths import rank_stem
from rasterscale.raster.imagery import resolve_spec
from rasterscale.scene import Scene
from rasterscale.settings import job_settings
from rasterscale.tasks.registry import task_spec
from rasterscale.tasks.regression.model import build_regressor, save_regressor
from rasterscale.tasks.regression.modelfiles import RegressorConfig
from rasterscale.tasks.segmentation.model import build_segmenter, save_segmenter
from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig
from synthetic import CRS, TRANSFORM, tile_windows, write_raster

REPO = Path(__file__).resolve().parents[1]
PATCH, OVERLAP = 400, 80
TILES = 200  # tiles per raster (about): the same work on every raster
RUNS = 3  # rank runs per raster (the median peak is the figure)
LABELS = ("background", "tree")  # the segmenter's classes
# runs a command and prints the peak RSS (KB) of its process tree's largest process: the merge's
PEAK_OF = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def write_segmenter(path: Path, labels: tuple[str, ...]) -> Path:
    """An untrained segmenter, the same in every run (its class map, noisy, decides the merge's polygons)."""
    import torch

    torch.manual_seed(0)
    cfg = SegmenterConfig(labels, patch_size=PATCH)
    save_segmenter(build_segmenter(cfg), cfg, path)
    return path


def write_regressor(path: Path, labels: tuple[str, ...]) -> Path:
    """An untrained U-Net regressor, the same in every run (no target scale: it predicts its raw outputs)."""
    import torch

    torch.manual_seed(0)
    cfg = RegressorConfig(labels, patch_size=PATCH)
    save_regressor(build_regressor(cfg), cfg, path)
    return path


@dataclass(frozen=True)
class DenseTask:
    """What the measure needs of a task whose ranks write blended rasters: the values it predicts (``labels``, as
    the merge's config names them) and how to write its untrained model file. The merge's outputs are the task's
    own (its spec's ``scene_outputs``)."""

    labels: tuple[str, ...]
    write_model: Callable[[Path, tuple[str, ...]], Path]


DENSE_TASKS: dict[str, DenseTask] = {
    "segmentation": DenseTask(LABELS, write_segmenter),
    "regression": DenseTask(("height",), write_regressor),
}


def task_config(task: str) -> dict[str, Any]:
    """The task, model, tiling, predict and merge sections of a validated config of ``task``: one CPU rank, workers 0
    (the merge section: regression's scene outputs depend on ``merge.tree_tops``)."""
    config = validate_config(
        {
            "task": task,
            "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
            "predict": {"accelerator": "cpu", "devices": 1, "workers": 0},
        }
    )
    return {key: config[key] for key in ("task", "model", "tiling", "predict", "merge")}


def band_of_rows(side: int, tiles: int = TILES) -> Any:
    """The manifest of the full-width tile rows, about ``tiles`` tiles, across the middle of a side x side
    raster."""
    manifest = manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS)
    offsets = sorted(set(manifest["row_off"]))
    rows = max(1, min(len(offsets), round(tiles * len(offsets) / len(manifest))))
    start = max(0, min(len(offsets) - rows, len(offsets) // 2 - rows // 2))
    return manifest[manifest["row_off"].isin(offsets[start : start + rows])]


def merge_peak_rss_mb(
    directory: Path, raster: Path, manifest: Path, stem: str, config: dict[str, Any]
) -> tuple[float, float]:
    """Run the merge entry of ``config``'s task on the rank's files in its own process, writing the task's scene
    outputs into ``directory``; its peak RSS (MB) and wall time (s)."""
    task = config["task"]
    outputs = {key: str(directory / name) for key, name in task_spec(task).scene_outputs(job_settings(config)).items()}
    scene = {
        "name": "scene",
        "raster": str(raster),
        "manifest": str(manifest),
        "rank_files": [stem],
        **outputs,
        "profile": str(directory / "predict_profile.json"),
    }
    job = directory / "merge-job.json"
    settings = job_settings({"task": task, "merge": {}, "predict": {}})
    MergeJob(0, (Scene.from_dict(scene),), tuple(DENSE_TASKS[task].labels), settings).write(job)
    command = [sys.executable, str(REPO / "scripts/merge.py"), "--job", str(job)]
    command += ["--record", str(directory / "merged.json")]
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK_OF, *command], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1]) / 1024, time.perf_counter() - started


def measure_dense_rss(workdir: Path, task: str, sides: tuple[int, ...], tiles: int = TILES) -> dict[str, Any]:
    """``task``'s (a key of :data:`DENSE_TASKS`) rank and merge peak RSS on each side x side raster, by side."""
    dense = DENSE_TASKS[task]
    model_file = dense.write_model(workdir / f"{task}.pt", dense.labels)
    config = task_config(task)
    result: dict[str, Any] = {}
    for side in sides:
        directory = workdir / f"{task}-rss-{side}"
        directory.mkdir(parents=True, exist_ok=True)
        chosen = band_of_rows(side, tiles)
        raster = write_raster(directory / "raster.tif", side, only=tile_windows(tiles_from_frame(chosen)))
        manifest = directory / "tiles.parquet"
        write_manifest(chosen, resolve_spec(raster), TileGrid(PATCH, OVERLAP), manifest)
        jobs = [
            run_predict_job(directory / f"run-{k}", raster, manifest, model_file, config["predict"], config=config)
            for k in range(RUNS)
        ]
        stem = rank_stem(directory / f"run-{RUNS - 1}" / "predict", "scene", 0)
        merge_mb, merge_s = merge_peak_rss_mb(directory, raster, manifest, stem, config)
        raster.unlink()
        peaks = [job.profiles[0]["host_rss_peak_mb"] for job in jobs]
        result[str(side)] = {
            "rank_rss_peak_mb": statistics.median(peaks),
            "rank_rss_peaks_mb": peaks,
            "merge_rss_peak_mb": round(merge_mb, 1),
            "predicted_tiles": jobs[0].profiles[0]["tiles"],
            "tile_rows": int(chosen["row_off"].nunique()),
            "job_wall_s": round(min(job.wall_s for job in jobs), 2),
            "merge_wall_s": round(merge_s, 2),
        }
    return result


def measure_segmentation_rss(workdir: Path, sides: tuple[int, ...], tiles: int = TILES) -> dict[str, Any]:
    """Segmentation's rank and merge peak RSS by side (:func:`measure_dense_rss`)."""
    return measure_dense_rss(workdir, "segmentation", sides, tiles)


def measure_regression_rss(workdir: Path, sides: tuple[int, ...], tiles: int = TILES) -> dict[str, Any]:
    """Regression's rank and merge peak RSS by side (:func:`measure_dense_rss`)."""
    return measure_dense_rss(workdir, "regression", sides, tiles)
