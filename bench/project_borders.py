"""make bench-project: a survey's inner borders through the real workflow. A detector trained by the workflow as the
demo trains it (a 4096² synthetic scene, 170 steps of 8 tiles); a held-out synthetic orthomosaic predicted whole,
and cut into 2 x 2 abutting scenes predicted as a project. Near the inner borders (within 2 m, and 4 m) it reports
the F1 of the whole scene, of the project's layer (whose seams read across the borders) and of the four scenes'
layers side by side (no seams), and the largest IoU between boxes of different scenes in the project's layer.
Writes results/bench-project.json. Not a test: training a detector worth comparing takes minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
import rasterio
import shapely
import yaml
from rasterio.enums import ColorInterp
from rasterio.windows import Window

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from rasterscale.atomic import write_json  # noqa: E402
from rasterscale.jobs.paths import RunPaths, trained_model  # noqa: E402
from rasterscale.raster.geo import box_pairs, pair_ious  # noqa: E402
from rasterscale.tasks.detection.metrics import evaluate_detections  # noqa: E402
from rasterscale.tools.synth import synthesize_scene  # noqa: E402

SIDE = 4096  # px of the held-out orthomosaic (0.1 m): 2 x 2 scenes of 2048 px
BANDS = (2.0, 4.0)  # m either side of an inner border
TILING = {"patch_size": 256, "overlap": 64}
MODEL = {"name": "crowns", "backbone": "resnet18", "fpn_channels": 128, "score_threshold": 0.4}
PREDICT = {"scenes": "all", "devices": 2, "batch_size": 4, "workers": 0, "accelerator": "cpu"}


def run_workflow(workdir: Path, config: dict) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    command += ["--configfile", str(workdir / "config.yaml"), "--cores", "2"]
    subprocess.run(command, check=True, capture_output=True, text=True)


def cut(source: Path, rows: int, columns: int, folder: Path) -> dict[str, dict]:
    """The raster cut into rows x columns abutting GeoTIFFs; their scenes."""
    folder.mkdir(parents=True, exist_ok=True)
    scenes = {}
    with rasterio.open(source) as src:
        height, width = src.height // rows, src.width // columns
        for row in range(rows):
            for column in range(columns):
                window = Window(column * width, row * height, width, height)
                profile = {**src.profile, "width": width, "height": height, "transform": src.window_transform(window)}
                if src.count > 3 and ColorInterp.alpha not in src.colorinterp:  # GDAL would make a 4th byte band alpha
                    profile.update(photometric="RGB", alpha="UNSPECIFIED")
                path = folder / f"part_{row}{column}.tif"
                with rasterio.open(path, "w", **profile) as dst:
                    dst.write(src.read(window=window))
                scenes[path.stem] = {"path": str(path)}
    return scenes


def predict_borders(root: Path) -> None:
    """Train as the demo does, then predict the held-out scene whole and as 2 x 2 scenes."""
    train = {
        "scenes": {"train": {"path": "resources/demo/train.tif", "annotations": "resources/demo/train.gpkg"}},
        "demo": {"scenes": {"train": {"width": 4096, "height": 4096, "seed": 1}}},
        "tiling": TILING,
        "model": MODEL,
        "train": {"scenes": ["train"], "devices": 2, "batch_size": 8, "lr": 0.002, "epochs": 4},
    }
    train["train"].update(max_steps=170, warmup_steps=20, workers=0)
    run_workflow(root / "train", train)
    model = {**MODEL, "file": str(root / "train" / trained_model(MODEL["name"]))}
    synthesize_scene(root / "whole.tif", root / "whole.gpkg", width=SIDE, height=SIDE, seed=7)
    whole = {"scenes": {"whole": {"path": str(root / "whole.tif")}}, "tiling": TILING, "model": model}
    run_workflow(root / "one", {**whole, "predict": PREDICT})
    parts = cut(root / "whole.tif", 2, 2, root / "parts")
    run_workflow(root / "four", {"scenes": parts, "tiling": TILING, "model": model, "predict": PREDICT})


def inner_borders(path: Path, band: float) -> shapely.Geometry:
    """The band of ``band`` m either side of the 2 x 2 cut's inner borders."""
    with rasterio.open(path) as src:
        b = src.bounds
    x, y = (b.left + b.right) / 2, (b.bottom + b.top) / 2
    lines = shapely.MultiLineString([[(x, b.bottom), (x, b.top)], [(b.left, y), (b.right, y)]])
    return lines.buffer(band)


def f1_in(detections: gpd.GeoDataFrame, truth: gpd.GeoDataFrame, area: shapely.Geometry) -> tuple[float, int]:
    """F1 (IoU 0.4, score 0.3: the evaluate section's defaults) of the detections and true crowns centred in
    ``area``; the number of true crowns there."""
    mine = detections[shapely.contains(area, detections.geometry.centroid.values)]
    true = truth[shapely.contains(area, truth.geometry.centroid.values)]
    metrics = evaluate_detections(
        mine.geometry.bounds.to_numpy(),
        mine["score"].to_numpy(),
        np.zeros(len(mine)),
        true.geometry.bounds.to_numpy(),
        np.zeros(len(true)),
        iou_threshold=0.4,
        score_threshold=0.3,
    )
    return metrics["f1"], len(true)


def max_iou_across_scenes(layer: gpd.GeoDataFrame) -> float:
    """The largest IoU between boxes of different scenes in a project's layer (0 where no two overlap)."""
    boxes = layer.geometry.bounds.to_numpy()
    i, j = box_pairs(boxes)
    scenes = layer["scene"].to_numpy()
    return float(pair_ious(boxes[i], boxes[j])[scenes[i] != scenes[j]].max(initial=0.0))


def measure(root: Path) -> dict:
    truth = gpd.read_file(root / "whole.gpkg")
    run = RunPaths(MODEL["name"])  # both prediction runs' outputs: results/crowns/ (model.name)
    whole = gpd.read_parquet(root / "one" / run.scene_file("whole", "detections.parquet"))
    project = gpd.read_parquet(root / "four" / run.project_file("detections.parquet"))
    apart = gpd.GeoDataFrame(
        pd.concat(
            [gpd.read_parquet(path) for path in sorted((root / "four" / run.root).glob("part_*/detections.parquet"))]
        ),
        crs=whole.crs,
    )
    results: dict = {"f1_whole_scene": f1_in(whole, truth, shapely.box(*truth.total_bounds).buffer(10))[0]}
    for band in BANDS:
        area = inner_borders(root / "whole.tif", band)
        (f1_whole, crowns), (f1_project, _), (f1_apart, _) = (f1_in(d, truth, area) for d in (whole, project, apart))
        results[f"within_{band:g}_m"] = {
            "crowns": crowns, "whole": f1_whole, "project": f1_project, "side_by_side": f1_apart
        }  # fmt: skip
    results["max_iou_across_scenes"] = max_iou_across_scenes(project)
    results["seams"] = sorted({source for source in project["source"] if "+" in source})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "results/bench-project.json"))
    parser.add_argument("--workdir", help="scratch folder, kept (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rasterscale-borders-") as scratch:
        root = Path(args.workdir or scratch)
        predict_borders(root)
        results = measure(root)
    results["seconds"] = round(time.perf_counter() - started)
    write_json(results, args.out)
    print(f"whole scene F1 {results['f1_whole_scene']:.3f}")
    for band in BANDS:
        row = results[f"within_{band:g}_m"]
        print(
            f"within {band:g} m of the inner borders ({row['crowns']} crowns): F1 whole scene {row['whole']:.3f}, "
            f"project {row['project']:.3f}, four scenes side by side {row['side_by_side']:.3f}"
        )
    print(f"largest IoU of boxes of different scenes in the project's layer: {results['max_iou_across_scenes']:.3f}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
