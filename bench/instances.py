"""Instances' merge at scale: stitching a million crowns, and its peak RSS on scenes of 4k to 32k a side.

The rank files are synthetic but shaped as a Mask R-CNN's ranks write them (:mod:`rasterscale.tasks.instances.
polygons`): crowns of 6-25 px radius with 20-40 vertices (an irregular outline, as a mask traced and simplified
gives), spread at random over the raster (they overlap each other too, as crowns do); every tile of a full
row-major grid (400 px, 80 px overlap) that holds at least half of a crown's box sees it, jittered by half a pixel
(the duplicates across overlaps), and clipped to the tile where the crown goes on beyond it (the cut instances).
The tiles are spread over 4 rank files in contiguous shards.

- ``merge``: :func:`~rasterscale.tasks.instances.merge.merge_scene` over about a million instances, in a process of
  its own bound to one core (as a merge job runs, one thread): reading the rank files, the merge, and writing
  crowns.parquet and crowns.gpkg; its wall time, CPU time and peak RSS. Then the same on all the cores (the
  polygons' intersections run on the cores the process may use).
- ``rss``: the same merge over the same number of crowns on rasters of each side: its memory grows with the
  crowns it holds (their polygons, pairs and the layer), not with the raster's pixels, which it never reads
  (the manifest's rows are the only thing that grows with the side: a few thousand tiles at 32k). Flat here means
  the largest raster's peak within a few percent of the smallest's.

``python bench/instances.py [--quick]`` runs it alone (``make bench`` runs it with the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd
import shapely

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "bench"))

from rasterscale.grid.manifest import manifest_frame, tile_grid, write_manifest  # noqa: E402
from rasterscale.grid.tile import TileGrid  # noqa: E402
from rasterscale.raster.geo import box_areas  # noqa: E402
from rasterscale.raster.imagery import resolve_spec  # noqa: E402
from rasterscale.tasks.instances.polygons import to_crs, write_instances_file  # noqa: E402
from synthetic import CRS, TRANSFORM, write_raster  # noqa: E402

PATCH, OVERLAP = 400, 80
RANKS = 4


def crown_polygons(n: int, side: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` irregular crowns (6-25 px radius, 20-40 vertices each) at random over a side x side raster."""
    radius = rng.uniform(6, 25, n)
    centre = rng.uniform(radius[:, None], side - radius[:, None], (n, 2))
    vertices = rng.integers(20, 41, n)
    owner = np.repeat(np.arange(n), vertices)
    step = np.arange(len(owner)) - np.repeat(np.cumsum(vertices) - vertices, vertices)
    theta = 2 * np.pi * step / vertices[owner]
    phase = rng.uniform(0, 2 * np.pi, (n, 2))
    wobble = 1 + 0.12 * np.sin(3 * theta + phase[owner, 0]) + 0.08 * np.sin(5 * theta + phase[owner, 1])
    r = radius[owner] * wobble
    coords = centre[owner] + np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1)
    return shapely.polygons(shapely.linearrings(coords, indices=owner))


def tile_views(manifest: pd.DataFrame, crowns: np.ndarray, seed: int = 0) -> pd.DataFrame:
    """The instances the tiles see (see the module docstring): tile_id, pixel polygon, score, cut."""
    rng = np.random.default_rng(seed)
    boxes = shapely.bounds(crowns)
    windows = manifest[["col_off", "row_off", "width", "height"]].to_numpy()
    cols, rows = np.unique(windows[:, 0]), np.unique(windows[:, 1])
    width, height = int(windows[0, 2]), int(windows[0, 3])
    c_lo, c_hi = np.searchsorted(cols + width, boxes[:, 0], "right"), np.searchsorted(cols, boxes[:, 2])
    r_lo, r_hi = np.searchsorted(rows + height, boxes[:, 1], "right"), np.searchsorted(rows, boxes[:, 3])
    seen, tiles = [], []
    for dc in range(3):  # a crown meets at most 3 tiles per axis
        for dr in range(3):
            c, r = c_lo + dc, r_lo + dr
            idx = np.flatnonzero((c < c_hi) & (r < r_hi))
            seen.append(idx)
            tiles.append(r[idx] * len(cols) + c[idx])  # tile_id of a row-major grid
    crown, tile = np.concatenate(seen), np.concatenate(tiles)
    w = windows[tile].astype(np.float64)
    tile_box = np.stack([w[:, 0], w[:, 1], w[:, 0] + w[:, 2], w[:, 1] + w[:, 3]], axis=1)
    box = boxes[crown]
    clipped = np.concatenate([np.maximum(box[:, :2], tile_box[:, :2]), np.minimum(box[:, 2:], tile_box[:, 2:])], 1)
    keep = box_areas(clipped) >= 0.5 * box_areas(box)
    crown, tile, box, tile_box = crown[keep], tile[keep], box[keep], tile_box[keep]
    cut = ((box[:, :2] < tile_box[:, :2]) | (box[:, 2:] > tile_box[:, 2:])).any(axis=1)  # crowns are in the raster
    polygons = crowns[crown].copy()
    polygons[cut] = shapely.intersection(polygons[cut], shapely.box(*tile_box[cut].T))
    polygons = jitter(polygons, rng.normal(0, 0.5, (len(polygons), 2)))
    return pd.DataFrame(
        {
            "tile_id": tile,
            "polygon": polygons,
            "score": rng.uniform(0.3, 1.0, len(polygons)).astype(np.float32),
            "cut": cut,
        }
    )


def jitter(polygons: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Each polygon moved by its own (dx, dy)."""
    coords, index = shapely.get_coordinates(polygons, return_index=True)
    return shapely.set_coordinates(polygons.copy(), coords + shift[index])


def write_rank_files(directory: Path, views: pd.DataFrame, n_tiles: int, ranks: int = RANKS) -> list[Path]:
    """The views as ``ranks`` rank files, each a contiguous shard of the tiles."""
    boxes = shapely.bounds(views["polygon"].to_numpy())
    frame = gpd.GeoDataFrame(
        {
            "tile_id": views["tile_id"].to_numpy(dtype=np.int64),
            "label": "tree",
            "score": views["score"].to_numpy(),
            "cut": views["cut"].to_numpy(),
            "px_xmin": boxes[:, 0],
            "px_ymin": boxes[:, 1],
            "px_xmax": boxes[:, 2],
            "px_ymax": boxes[:, 3],
        },
        geometry=to_crs(views["polygon"].to_numpy(), TRANSFORM),
        crs=CRS,
    )
    shard = frame["tile_id"].to_numpy() * ranks // n_tiles
    paths = []
    for rank in range(ranks):
        path = directory / f"rank-{rank}.parquet"
        write_instances_file(frame[shard == rank], path)
        paths.append(path)
    return paths


def synthetic_scene(directory: Path, side: int, n_crowns: int, seed: int = 0) -> dict[str, Any]:
    """A sparse raster of ``side``, its manifest and the rank files of ``n_crowns`` crowns over it."""
    directory.mkdir(parents=True, exist_ok=True)
    raster = write_raster(directory / "raster.tif", side, only=[])
    manifest = manifest_frame(tile_grid(side, side, PATCH, OVERLAP), TRANSFORM, CRS)
    write_manifest(manifest, resolve_spec(raster), TileGrid(PATCH, OVERLAP), directory / "tiles.parquet")
    views = tile_views(manifest, crown_polygons(n_crowns, side, np.random.default_rng(seed)), seed)
    ranks = write_rank_files(directory, views, len(manifest))
    return {
        "rank_files": [str(p) for p in ranks],
        "manifest": str(directory / "tiles.parquet"),
        "raster": str(raster),
        "gpkg": str(directory / "crowns.gpkg"),
        "parquet": str(directory / "crowns.parquet"),
        "instances": len(views),
        "cut": int(views["cut"].sum()),
        "tiles": len(manifest),
        "vertices_mean": round(float(shapely.get_num_coordinates(views["polygon"].to_numpy()).mean()), 1),
    }


# the merge in a process of its own that imports what a merge job does (no torch): its wall time and its peak RSS
# (VmHWM: since its exec; getrusage's ru_maxrss would also count what the process it was forked from held then)
MERGE_CHILD = """
import json, sys, time
from pathlib import Path
from rasterscale.config.schema import validate_config
from rasterscale.settings import settings_of
from rasterscale.tasks.instances.merge import merge_scene
job = json.loads(sys.argv[1])
started, cpu = time.perf_counter(), time.process_time()
merge = settings_of(validate_config({})).merge
crowns = merge_scene(job["rank_files"], job["manifest"], job["raster"], job["gpkg"], job["parquet"], merge)
seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
peak_mb = round(int(hwm.split()[1]) / 1024, 1)
print(json.dumps({"seconds": round(seconds, 2), "cpu_s": round(cpu, 2), "rss_peak_mb": peak_mb, "crowns": len(crowns)}))
"""


def merge_in_process(job: dict[str, Any], cores: set[int] | None = None) -> dict[str, Any]:
    """``merge_scene`` of a synthetic scene, in a fresh process (:data:`MERGE_CHILD`), bound to ``cores`` (None:
    the cores this one may use)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    command = [sys.executable, "-c", MERGE_CHILD, json.dumps(job)]

    def bind() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)

    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env, preexec_fn=bind).stdout
    return json.loads(output.strip().splitlines()[-1])


def measure_instances_merge(workdir: Path, n_crowns: int, rss_sides: tuple[int, ...], rss_crowns: int) -> dict:
    """The million-crown merge (``n_crowns`` crowns on a 40k raster: about 1.5 instances each), then the merge of
    ``rss_crowns`` crowns on rasters of each of ``rss_sides``."""
    side = 40_000
    job = synthetic_scene(workdir / "instances-merge", side, n_crowns)
    merged = merge_in_process(job, cores={min(os.sched_getaffinity(0))})  # a merge job's one thread
    every = merge_in_process(job)
    result: dict[str, Any] = {
        "merge": {
            **merged,
            "all_cores": {"cores": len(os.sched_getaffinity(0)), **{k: every[k] for k in ("seconds", "cpu_s")}},
            **{k: job[k] for k in ("instances", "cut", "tiles", "vertices_mean")},
            "drawn": n_crowns,
            "side": side,
        },
        "rss": {},
    }
    for rss_side in rss_sides:
        job = synthetic_scene(workdir / f"instances-rss-{rss_side}", rss_side, rss_crowns)
        merged = merge_in_process(job)
        result["rss"][str(rss_side)] = {**merged, **{k: job[k] for k in ("instances", "tiles")}, "drawn": rss_crowns}
    return result


def measure_instances_rank_rss(workdir: Path, sides: tuple[int, ...], count: int) -> dict:
    """Peak RSS of an instances rank (one CPU rank) on rasters of each side, ``count`` tiles spread over each: an
    untrained Mask R-CNN (resnet18, 128 channels) at score 0 keeps ``detections_per_tile`` (100) instances a tile,
    whose masks (crops of their tiles) become polygons and go to the rank file. Its memory is the model's and one
    batch's: flat in the raster's side."""
    import torch

    from measures import predict_spread_tiles
    from rasterscale.config.schema import validate_config
    from rasterscale.tasks.instances.model import build_instance_model, save_instance_model
    from rasterscale.tasks.instances.modelfiles import InstanceConfig

    torch.manual_seed(0)
    cfg = InstanceConfig(backbone="resnet18", fpn_channels=128, patch_size=PATCH, score_threshold=0.0)
    model_file = workdir / "instances-model.pt"
    save_instance_model(build_instance_model(cfg), cfg, model_file)
    settings = validate_config({"task": "instances", "predict": {"accelerator": "cpu", "devices": 1, "workers": 0}})
    config = {key: settings[key] for key in ("task", "model", "predict")}
    result: dict[str, Any] = {}
    for side in sides:
        directory = workdir / f"instances-rank-rss-{side}"
        job, _ = predict_spread_tiles(directory, side, count, model_file, {}, config=config)
        profile = job.profiles[0]
        crowns = len(gpd.read_parquet(directory / "predict/scene/rank-0.parquet"))
        result[str(side)] = {
            "rss_peak_mb": profile["host_rss_peak_mb"],
            "tiles": profile["tiles"],
            "instances": crowns,
            "job_wall_s": round(job.wall_s, 2),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the harness, not the targets")
    parser.add_argument("--crowns", type=int, help="crowns of the big merge (default: the bench's size)")
    args = parser.parse_args()
    from suite import QUICK, Sizes

    sizes = QUICK if args.quick else Sizes()
    crowns = args.crowns or sizes.instances_crowns
    with tempfile.TemporaryDirectory(prefix="rasterscale-bench-instances-") as workdir:
        result = measure_instances_merge(Path(workdir), crowns, sizes.instances_rss_sides, sizes.instances_rss_crowns)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
