"""The points task at scale (make bench): a scene's 1,000,000 points from the ranks' decoded peaks to its merged
layer, and a prediction job's throughput beside segmentation's at the same encoder.

The merge's shape is the detection merge bench's (bench/measures.py: a 40k x 40k raster of 400 px tiles, overlap
80): points on whole pixels on a jittered grid over the raster (about 40 px apart), each decoded by every tile
that holds it (a point in an overlap by 2 or 4 tiles), and some found a second time a pixel away (a peak either
side of a core's edge: what the merge's one point per place removes). Timed, in memory as the detection merge's
figure is: each batch's rows kept by their tiles' cores (:func:`~rasterscale.tasks.points.layer.in_cores`), the ranks'
frames (2 ranks), then the scene's one point per place within ``merge.point_distance``; beside it (no target),
the merge job over the rank files (read, the same merge, GeoParquet and GeoPackage written: the GeoPackage most
of it). The decoding on the device (a max-pool, a top-k) is in the job's figure: a points job predicts the same
tiles as a segmentation job, at the same U-Net on the same encoder, with its peaks decoded per batch where
segmentation blends its probabilities.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from jobs import run_predict_job
from rasterscale.atomic import write_geoparquet
from rasterscale.config.schema import validate_config
from rasterscale.grid.manifest import build_manifest, manifest_frame, tile_grid, tiles_from_frame, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.raster.imagery import resolve_spec
from rasterscale.tasks.blending import tile_cores
from rasterscale.tasks.points.layer import in_cores, points_frame
from rasterscale.tasks.points.merge import merge_scene, one_per_place_layer
from segmentation import write_segmenter
from synthetic import CRS, TRANSFORM, write_raster

PATCH, OVERLAP = 400, 80
DISTANCE_M = 1.0  # merge.point_distance's default
BATCH = 8  # tiles a batch
TWICE = 0.02  # the share of points a neighbouring tile finds again a pixel away


def decoded_peaks(tiles: list[Any], xy: np.ndarray, scores: np.ndarray) -> list[np.ndarray]:
    """Each batch's decoded rows (B, N, 4: x, y in the tile's pixels, score, class 0; rows of score 0 pad a tile)
    of the points (whole raster pixels) its tiles hold: what a rank's decoding gives, before the core rule."""
    order = np.argsort(xy[:, 0], kind="stable")
    xs, sorted_xy, sorted_scores = xy[order, 0], xy[order], scores[order]
    found = []
    for tile in tiles:
        lo, hi = np.searchsorted(xs, [tile.col_off, tile.col_off + tile.width])
        column, score = sorted_xy[lo:hi], sorted_scores[lo:hi]
        inside = (column[:, 1] >= tile.row_off) & (column[:, 1] < tile.row_off + tile.height)
        rows = column[inside] - (tile.col_off, tile.row_off)
        found.append(np.column_stack([rows, score[inside], np.zeros(len(rows))]).astype(np.float32))
    batches = []
    for start in range(0, len(found), BATCH):
        chunk = found[start : start + BATCH]
        padded = np.zeros((len(chunk), max(len(rows) for rows in chunk), 4), dtype=np.float32)
        for k, rows in enumerate(chunk):
            padded[k, : len(rows)] = rows
        batches.append(padded)
    return batches


def measure_points_merge(workdir: Path, n_points: int = 1_000_000, side: int = 40_000) -> dict[str, Any]:
    """The rank side's rows and files and the scene merge of ``n_points`` points on a ``side`` px raster."""
    workdir.mkdir(parents=True, exist_ok=True)
    raster = write_raster(workdir / "points.tif", side, only=[])
    frame = manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS)
    manifest = workdir / "points-tiles.parquet"
    write_manifest(frame, resolve_spec(raster), TileGrid(PATCH, OVERLAP), manifest)
    tiles = tiles_from_frame(frame)
    cores = tile_cores(tiles, side, side)
    rng = np.random.default_rng(0)
    spacing = side / np.sqrt(n_points)  # a jittered grid: points a place apart (merge.point_distance is 10 px)
    grid = np.stack(np.meshgrid(np.arange(side // spacing), np.arange(side // spacing)), -1).reshape(-1, 2) + 0.5
    jitter = rng.uniform(-spacing / 4, spacing / 4, size=grid.shape)
    xy = np.clip(np.floor(grid * spacing + jitter), 1, side - 2)
    n_points = len(xy)
    again = xy[rng.random(n_points) < TWICE] + (1.0, 0.0)  # a second peak a pixel to the right
    scores = rng.uniform(0.3, 1.0, n_points)
    decoded = decoded_peaks(tiles, np.concatenate([xy, again]), np.concatenate([scores, scores[: len(again)] / 2]))
    started = time.perf_counter()
    half = len(decoded) // 2
    frames = []
    for own in (range(half), range(half, len(decoded))):  # each rank's batches
        rows = [in_cores(decoded[b], tiles[b * BATCH : (b + 1) * BATCH], cores) for b in own]
        frames.append(points_frame(np.concatenate(rows), ["tree"], TRANSFORM, CRS))
    ranks_s = time.perf_counter() - started
    merged = one_per_place_layer(pd.concat(frames, ignore_index=True), abs(TRANSFORM.a), DISTANCE_M)
    seconds = time.perf_counter() - started
    files = []
    for rank, frame_of_rank in enumerate(frames):  # the files, as the job writes and reads them: not in the figure
        files.append(workdir / f"points-rank-{rank}.parquet")
        write_geoparquet(frame_of_rank, files[-1])
    written = time.perf_counter()
    layer = merge_scene(files, manifest, raster, workdir / "points.gpkg", workdir / "points.parquet", DISTANCE_M)
    files_s = time.perf_counter() - written
    raster.unlink()
    same = np.array_equal(layer[["px_x", "px_y"]].to_numpy(), merged[["px_x", "px_y"]].to_numpy())
    assert same, "the merge job's layer is not the figure's"
    return {
        "seconds": round(seconds, 3),
        "ranks_s": round(ranks_s, 3),
        "merge_s": round(seconds - ranks_s, 3),
        "merge_job_s": round(files_s, 3),  # reading the rank files, the same merge, GeoParquet and GeoPackage
        "points": n_points,
        "decoded": int(sum((batch[..., 2] > 0).sum() for batch in decoded)),
        "kept": len(merged),
        "tiles": len(tiles),
    }


def job_config(task: str, model: dict[str, Any]) -> dict[str, Any]:
    config = validate_config(
        {
            "task": task,
            "model": model,
            "tiling": {"patch_size": 256, "overlap": 32},
            "predict": {"accelerator": "cpu", "devices": 1, "workers": 1, "batch_size": 8, "precision": "32-true"},
        }
    )
    return {key: config[key] for key in ("task", "model", "tiling", "predict", "merge")}


def write_point_model(path: Path) -> Path:
    """An untrained point model, the segmenter's U-Net on the same encoder, every peak kept (score threshold 0: the
    noise's local maxima, about one in a 17 px window, a dense forest's tree tops at 0.1 m)."""
    import torch

    from rasterscale.tasks.points.model import build_points_model, save_points_model
    from rasterscale.tasks.points.modelfiles import PointsConfig

    torch.manual_seed(0)
    cfg = PointsConfig(patch_size=256, score_threshold=0.0)
    save_points_model(build_points_model(cfg), cfg, path)
    return path


def measure_points_job(workdir: Path, side: int = 4096) -> dict[str, Any]:
    """A points job and a segmentation job (one CPU rank, the same U-Net on ResNet-18) over the same ``side`` px
    scene: each one's tiles/s, the points job's points/s, and its tiles/s over segmentation's."""
    workdir.mkdir(parents=True, exist_ok=True)
    raster = write_raster(workdir / "scene.tif", side)
    manifest = workdir / "tiles.parquet"
    write_manifest(build_manifest(raster, 256, 32), resolve_spec(raster), TileGrid(256, 32), manifest)
    models = {
        "points": write_point_model(workdir / "points.pt"),
        "segmentation": write_segmenter(workdir / "segmenter.pt", ("background", "tree")),
    }
    found: dict[str, Any] = {}
    for task, model in models.items():
        config = job_config(task, {})
        job = run_predict_job(workdir / task, raster, manifest, model, config["predict"], config=config)
        profile = job.profiles[0]
        found[task] = {"tiles": profile["tiles"], "tiles_per_s": round(profile["tiles"] / profile["wall_s"], 2)}
        if task == "points":
            import geopandas as gpd

            points = len(gpd.read_parquet(workdir / "points/predict/scene/rank-0.parquet"))
            found[task] |= {"points": points, "points_per_s": round(points / profile["wall_s"], 1)}
    raster.unlink()
    ratio = found["points"]["tiles_per_s"] / found["segmentation"]["tiles_per_s"]
    return {**found, "points_vs_segmentation": round(ratio, 3), "side": side, "model": "U-Net on resnet18, 256 px"}
