"""make bench-deepforest: rasterscale against DeepForest 2.1.0 on the same raster with the same model folder.

1. A DeepForest-format model (ResNet-50 RetinaNet written by DeepForest's own ``save_pretrained``) is fine-tuned
   by rasterscale (``train.init``) on a synthetic 4096² orthomosaic; rasterscale writes the trained model as a
   DeepForest model folder (results/models/{name}/). Done once per work folder (``--retrain`` redoes it).
2. The held-out 4096² scene is predicted by both, each as its users run it, each timed from process start to
   the final layer:
   - DeepForest (its own environment, .venv-deepforest): ``main.deepforest`` with the folder as model name, then
     ``predict_tile(path, patch_size=400, patch_overlap=0.05)``, all its defaults (batch 1, fp32, single).
   - rasterscale: ``snakemake --cores N`` of the scene's tile manifest, prediction and merge, with the config a
     user writes for this machine (2 CPU ranks, bf16, batch 4; DeepForest's 400 px patches, 20 px overlap and
     thresholds, so that both see the same windows).
3. Printed: boxes of each side, agreement (one-to-one matching at IoU >= 0.5, F1) over the scene and away from
   tile edges, F1 of each against the scene's ground truth, and the throughput ratio.

DeepForest's boxes are in raster pixels; they are moved to the CRS with the raster's transform at pixel corners
(DeepForest's own ``image_to_geo_coordinates`` uses pixel centres, half a pixel off) and written as a GeoPackage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import geopandas as gpd  # noqa: E402
import rasterio  # noqa: E402

from rasterscale.grid.manifest import tile_offsets  # noqa: E402
from rasterscale.jobs.paths import RunPaths  # noqa: E402
from rasterscale.raster.geo import geometries_to_pixel_boxes, pixel_boxes_to_polygons  # noqa: E402
from rasterscale.tasks.detection.metrics import evaluate_detections, match_detections, precision_recall_f1  # noqa: E402
from rasterscale.tasks.detectors.merge import BOX_COLUMNS  # noqa: E402

DEEPFOREST = REPO / "bench" / "deepforest"
NAME, TRAIN, HELDOUT = "deepforest_finetuned", "bench_train", "bench_heldout"
LAYER = RunPaths(NAME).scene_file(HELDOUT, "detections.parquet")  # the run's outputs: results/{model.name}/
PATCH, OVERLAP = 400, 20  # DeepForest's predict_tile defaults: patch_size 400, patch_overlap 0.05


def bench_config(start_model: Path, steps: int, side: int) -> dict[str, Any]:
    """The workflow config: fine-tune from ``start_model`` on one synthetic scene, predict the other."""
    return {
        "scenes": {
            TRAIN: {"path": f"resources/demo/{TRAIN}.tif", "annotations": f"resources/demo/{TRAIN}.gpkg"},
            HELDOUT: {"path": f"resources/demo/{HELDOUT}.tif", "annotations": f"resources/demo/{HELDOUT}.gpkg"},
        },
        "demo": {
            "scenes": {
                TRAIN: {"width": side, "height": side, "seed": 1},
                HELDOUT: {"width": side, "height": side, "seed": 2},
            }
        },
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        # DeepForest's thresholds (its config overrides the model file's): score 0.1, per-patch NMS 0.05
        "model": {"name": NAME, "score_threshold": 0.1, "nms_threshold": 0.05},
        "train": {
            "init": str(start_model),
            "scenes": [TRAIN],
            "devices": 2,
            "batch_size": 4,
            "lr": 0.001,
            "lr_reference_batch": 4,
            "epochs": 100,
            "max_steps": steps,
            "warmup_steps": 10,
            "val_every_n_epochs": 100,
            "workers": 0,
        },
        "predict": {"scenes": [HELDOUT], "devices": 2, "batch_size": 4, "workers": 0, "strategy": "window"},
        "merge": {"iou_threshold": 0.15},  # DeepForest's cross-window NMS threshold
    }


def snakemake(workdir: Path, *targets: str, cores: int) -> float:
    """Run the workflow on the bench config in ``workdir``; its wall time in seconds."""
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(workdir / "config.yaml"),
        "--cores",
        str(cores),
        *targets,  # after a one-valued option: --configfile takes several
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"snakemake failed ({result.returncode}):\n{result.stderr[-5000:]}")
    return wall


def run_deepforest(python: Path, model: Path, raster: Path, out_dir: Path, **options: Any) -> tuple[float, dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        str(python),
        str(DEEPFOREST / "predict_tile.py"),
        *("--model", str(model), "--raster", str(raster)),
        *("--out", str(out_dir / "boxes.csv"), "--timings", str(out_dir / "timings.json")),
        *(arg for key, value in options.items() if value for arg in (f"--{key.replace('_', '-')}", str(value))),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out_dir)  # its lightning_logs/
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"DeepForest failed ({result.returncode}):\n{result.stderr[-5000:]}")
    return wall, json.loads((out_dir / "timings.json").read_text())


def inner_grid_lines(length: int) -> np.ndarray:
    """Pixel positions of the tile edges inside the raster (both sides use the same windows)."""
    offsets = np.asarray(tile_offsets(length, PATCH, OVERLAP))
    lines = np.concatenate([offsets, offsets + PATCH])
    return np.unique(lines[(lines > 0) & (lines < length)])


def away_from_edges(boxes: np.ndarray, width: int, height: int, margin: float = 2.0) -> np.ndarray:
    """True for boxes that no inner tile edge crosses (within ``margin`` px): no tile sees them cut."""
    keep = np.ones(len(boxes), dtype=bool)
    for lines, lo, hi in ((inner_grid_lines(width), 0, 2), (inner_grid_lines(height), 1, 3)):
        crossed = (boxes[:, lo, None] < lines[None, :] + margin) & (boxes[:, hi, None] > lines[None, :] - margin)
        keep &= ~crossed.any(axis=1)
    return keep


def agreement(a: np.ndarray, a_scores: np.ndarray, b: np.ndarray, iou: float) -> dict[str, float]:
    """One-to-one agreement of box sets ``a`` and ``b`` (``b`` as the reference) at IoU >= ``iou``."""
    matched = int(match_detections(a, a_scores, b, iou).sum())
    precision, recall, f1 = precision_recall_f1(matched, len(a), len(b))
    return {
        "f1": round(f1, 4),
        "precision": round(precision, 4),
        "recall": round(recall, 4),
        "matched": matched,
        "rasterscale": len(a),
        "deepforest": len(b),
        "iou": iou,
    }


def scores_against_truth(boxes: np.ndarray, scores: np.ndarray, truth: np.ndarray, iou: float) -> dict[str, float]:
    zeros = np.zeros(len(boxes), dtype=np.int64)
    metrics = evaluate_detections(boxes, scores, zeros, truth, np.zeros(len(truth), dtype=np.int64), iou, 0.0)
    return {k: round(float(metrics[k]), 4) for k in ("precision", "recall", "f1", "map50")}


def compare(workdir: Path, df_dir: Path) -> dict[str, Any]:
    raster = workdir / f"resources/demo/{HELDOUT}.tif"
    with rasterio.open(raster) as src:
        width, height, transform, crs = src.width, src.height, src.transform, src.crs
    ours = gpd.read_parquet(workdir / LAYER)
    ours_boxes, ours_scores = ours[BOX_COLUMNS].to_numpy(float), ours["score"].to_numpy(float)
    theirs = gpd.pd.read_csv(df_dir / "boxes.csv")
    theirs_boxes, theirs_scores = theirs[["xmin", "ymin", "xmax", "ymax"]].to_numpy(float), theirs["score"].to_numpy()
    moved = gpd.GeoDataFrame(theirs, geometry=pixel_boxes_to_polygons(theirs_boxes, transform), crs=crs)
    moved.to_file(df_dir / "deepforest.gpkg", layer="detections", driver="GPKG")
    truth = gpd.read_file(workdir / f"resources/demo/{HELDOUT}.gpkg").to_crs(crs)
    truth_boxes = geometries_to_pixel_boxes(truth.geometry.to_numpy(), transform)
    ours_away, theirs_away = away_from_edges(ours_boxes, width, height), away_from_edges(theirs_boxes, width, height)
    return {
        "agreement": agreement(ours_boxes, ours_scores, theirs_boxes, 0.5),
        "agreement_away_from_edges": agreement(
            ours_boxes[ours_away], ours_scores[ours_away], theirs_boxes[theirs_away], 0.5
        ),
        "truth": {
            "boxes": len(truth_boxes),
            **{
                f"iou{iou}": {
                    "rasterscale": scores_against_truth(ours_boxes, ours_scores, truth_boxes, iou),
                    "deepforest": scores_against_truth(theirs_boxes, theirs_scores, truth_boxes, iou),
                }
                for iou in (0.4, 0.5)
            },
        },
        "pixels": width * height,
    }


def check_measured(result: dict[str, Any]) -> None:
    """A figure over nothing is no figure: fail loudly when either side found no box."""
    counts = result["agreement"]
    if not counts["rasterscale"] or not counts["deepforest"]:
        raise SystemExit(
            f"side-by-side: rasterscale found {counts['rasterscale']} boxes and DeepForest {counts['deepforest']}: "
            "the fine-tuned model detects nothing, no figure is measured (train longer: --steps)"
        )


def report(result: dict[str, Any]) -> str:
    a, e, t = result["agreement"], result["agreement_away_from_edges"], result["truth"]
    rs, df = result["rasterscale"], result["deepforest"]
    lines = [
        f"side by side on {result['pixels'] / 1e6:.1f} Mpx ({HELDOUT}), model {result['model']}",
        f"  boxes: rasterscale {a['rasterscale']}, DeepForest {a['deepforest']}",
        f"  agreement F1 @IoU>=0.5: {a['f1']:.3f} ({a['matched']} matched) [target >= 0.95]",
        f"  agreement away from tile edges: {e['f1']:.3f} ({e['matched']} matched of {e['rasterscale']} / "
        f"{e['deepforest']})",
    ]
    for iou in (0.4, 0.5):
        ours, theirs = t[f"iou{iou}"]["rasterscale"], t[f"iou{iou}"]["deepforest"]
        lines.append(
            f"  F1 vs ground truth ({t['boxes']} boxes) @IoU>={iou}: rasterscale {ours['f1']:.3f} "
            f"(P {ours['precision']:.3f} R {ours['recall']:.3f}), DeepForest {theirs['f1']:.3f} "
            f"(P {theirs['precision']:.3f} R {theirs['recall']:.3f})"
        )
    lines += [
        f"  wall: rasterscale {rs['wall_s']:.1f} s ({rs['how']}), DeepForest {df['wall_s']:.1f} s "
        f"(import {df['import_s']} s, load {df['load_s']} s, predict_tile {df['predict_tile_s']} s, "
        f"{df['threads']} threads, batch {df['batch_size']})",
        f"  throughput: rasterscale {result['pixels'] / rs['wall_s'] / 1e6:.3f} Mpx/s, DeepForest "
        f"{result['pixels'] / df['wall_s'] / 1e6:.3f} Mpx/s: x{result['speedup']:.2f} [target >= 3]",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=str(REPO / "results/bench-deepforest"))
    parser.add_argument(
        "--deepforest-python",
        default=str(REPO / ".venv-deepforest/bin/python"),
        type=os.path.abspath,  # DeepForest runs in its own folder; not resolved: the venv's python is a link
    )
    parser.add_argument("--steps", type=int, default=120, help="fine-tuning steps (effective batch 4)")
    parser.add_argument("--side", type=int, default=4096, help="side of the synthetic scenes in pixels")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--retrain", action="store_true", help="fine-tune again even if the model exists")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    start_model = workdir / "start-model"
    if not (start_model / "model.safetensors").exists():
        subprocess.run(
            [args.deepforest_python, str(DEEPFOREST / "start_model.py"), "--out", str(start_model)], check=True
        )
    (workdir / "config.yaml").write_text(yaml.safe_dump(bench_config(start_model, args.steps, args.side)))
    folder = workdir / f"results/models/{NAME}"
    if args.retrain:
        shutil.rmtree(workdir / "results/models", ignore_errors=True)
    if not (folder / "model.safetensors").exists():
        print(f"fine-tuning {start_model} for {args.steps} steps ...", flush=True)
        train_s = snakemake(workdir, f"results/models/{NAME}/model.safetensors", cores=args.cores)
        print(f"fine-tuned in {train_s:.0f} s -> {folder}", flush=True)
    snakemake(workdir, f"resources/demo/{HELDOUT}.tif", cores=args.cores)  # the scene itself is not timed
    shutil.rmtree(workdir / RunPaths(NAME).scene_dir(HELDOUT), ignore_errors=True)
    ours_wall = snakemake(workdir, LAYER, cores=args.cores)
    df_wall, df_timings = run_deepforest(
        Path(args.deepforest_python), folder, workdir / f"resources/demo/{HELDOUT}.tif", workdir / "deepforest"
    )
    result = compare(workdir, workdir / "deepforest")
    result["model"] = str(folder)
    result["rasterscale"] = {"wall_s": round(ours_wall, 2), "how": "snakemake: manifest + predict + merge"}
    result["deepforest"] = {"wall_s": round(df_wall, 2), **df_timings}
    result["speedup"] = round(df_wall / ours_wall, 3)
    check_measured(result)
    (workdir / "side_by_side.json").write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))


if __name__ == "__main__":
    main()
