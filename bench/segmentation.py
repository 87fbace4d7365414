"""Segmentation's memory at scale: peak RSS of a prediction rank and of the merge on rasters of 4k to 32k a side.

Each raster gets the manifest of a full-width band of tile rows across its middle: the worst case for the rank's
strip-bounded blend (it holds a whole row of tiles' class sums until the row below is predicted), so the figure
shows what the rank's memory grows with (the raster's width, by a row of tiles), and that it does not grow with
the raster's area. The merge then writes the whole classes.tif and probabilities.tif COGs and classes.gpkg of the
raster, block by block. The model is an untrained segmenter, seeded: the rank's memory does not depend on its
weights, but the merge's does, through classes.gpkg: an untrained model's noisy class map is a worst case of
many polygons and one region with thousands of holes across the band.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from jobs import run_predict_job
from rasterscale.config import validate_config
from rasterscale.imagery import resolve_spec
from rasterscale.rankfiles import rank_stem
from rasterscale.segmentation.model import SegmenterConfig, build_segmenter, save_segmenter
from rasterscale.tiling import manifest_frame, tile_grid, tiles_from_frame, write_manifest
from synthetic import CRS, TRANSFORM, tile_windows, write_raster

REPO = Path(__file__).resolve().parents[1]
PATCH, OVERLAP = 400, 80
LABELS = ("background", "tree")
# runs a command and prints the peak RSS (KB) of its process tree's largest process: the merge's
PEAK_OF = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def write_segmenter(path: Path) -> Path:
    """An untrained segmenter, the same in every run (its class map, noisy, decides the merge's polygons)."""
    import torch

    torch.manual_seed(0)
    cfg = SegmenterConfig(LABELS, patch_size=PATCH)
    save_segmenter(build_segmenter(cfg), cfg, path)
    return path


def segmentation_config() -> dict[str, Any]:
    config = validate_config(
        {
            "task": "segmentation",
            "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
            "predict": {"accelerator": "cpu", "devices": 1, "workers": 0},
        }
    )
    return {key: config[key] for key in ("task", "model", "tiling", "predict")}


def band_of_rows(side: int, rows: int) -> Any:
    """The manifest of ``rows`` full-width tile rows across the middle of a side x side raster."""
    manifest = manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS)
    offsets = sorted(set(manifest["row_off"]))
    middle = offsets[len(offsets) // 2 : len(offsets) // 2 + rows]
    return manifest[manifest["row_off"].isin(middle)]


def merge_peak_rss_mb(directory: Path, raster: Path, manifest: Path, stem: str) -> tuple[float, float]:
    """Run the merge entry on the rank's files in its own process; its peak RSS (MB) and wall time (s)."""
    import time

    scene = {
        "name": "scene",
        "raster": str(raster),
        "manifest": str(manifest),
        "rank_files": [stem],
        "classes": str(directory / "classes.tif"),
        "probabilities": str(directory / "probabilities.tif"),
        "gpkg": str(directory / "classes.gpkg"),
        "profile": str(directory / "predict_profile.json"),
    }
    job = directory / "merge-job.json"
    job.write_text(json.dumps({"scenes": [scene]}))
    config = {"task": "segmentation", "labels": list(LABELS), "merge": {}, "predict": {}}
    command = [sys.executable, str(REPO / "scripts/merge.py"), "--job", str(job), "--config", json.dumps(config)]
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK_OF, *command], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1]) / 1024, time.perf_counter() - started


def measure_segmentation_rss(workdir: Path, sides: tuple[int, ...], rows: int = 2) -> dict[str, Any]:
    checkpoint = write_segmenter(workdir / "segmenter.pt")
    config = segmentation_config()
    result: dict[str, Any] = {}
    for side in sides:
        directory = workdir / f"seg-rss-{side}"
        directory.mkdir(parents=True, exist_ok=True)
        chosen = band_of_rows(side, rows)
        raster = write_raster(directory / "raster.tif", side, only=tile_windows(tiles_from_frame(chosen)))
        manifest = directory / "tiles.parquet"
        write_manifest(chosen, resolve_spec(raster), manifest)
        job = run_predict_job(directory, raster, manifest, checkpoint, config["predict"], config=config)
        merge_mb, merge_s = merge_peak_rss_mb(directory, raster, manifest, rank_stem(directory / "predict", "scene", 0))
        raster.unlink()
        profile = job.profiles[0]
        result[str(side)] = {
            "rank_rss_peak_mb": profile["host_rss_peak_mb"],
            "merge_rss_peak_mb": round(merge_mb, 1),
            "predicted_tiles": profile["tiles"],
            "tile_rows": rows,
            "job_wall_s": round(job.wall_s, 2),
            "merge_wall_s": round(merge_s, 2),
        }
    return result
