"""make bench-scenes: the whole workflow (tile manifests, prediction, merge: `snakemake --cores 2`) over many small
scenes against one scene of the same total pixels, from one model file, every figure measured in this one run.

Runs, each a fresh working directory and a real `snakemake` call, timed from start to exit:

- ``single``: one scene of side ``round(side * sqrt(scenes))`` (the baseline of every ratio);
- ``batched``: ``scenes`` scenes of ``side`` x ``side`` (a glob of rasters), ``predict.scenes_per_job`` each job;
- ``per_scene``: the same scenes (or the first ``--per-scene`` of them), ``scenes_per_job: 1``: one prediction
  and one merge job per scene, as before batching.

The model file is an untrained, seeded resnet18 RetinaNet (bench/synthetic.py: timings do not depend on the
weights), at native scale; rasters are synthetic tiled GeoTIFFs. The time of each kind of job comes from
Snakemake's benchmark files (process wall time, summed over the jobs of that kind).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

from rasterscale.config.schema import default_model_name  # noqa: E402
from rasterscale.jobs.paths import RunPaths  # noqa: E402
from synthetic import write_detector, write_raster  # noqa: E402

KINDS = ("tiles", "predict", "merge")


def config(model_file: Path, scenes: Any, scenes_per_job: int, devices: int) -> dict[str, Any]:
    return {
        "scenes": scenes,
        "model": {"backbone": "resnet18", "file": str(model_file)},
        "predict": {
            "scenes": "all",
            "accelerator": "cpu",
            "devices": devices,
            "workers": 1,
            "batch_size": 4,
            "scenes_per_job": scenes_per_job,
        },
    }


def job_seconds(workdir: Path) -> dict[str, float]:
    """Wall seconds of the jobs of each kind (Snakemake's benchmark files), summed."""
    totals = dict.fromkeys(KINDS, 0.0)
    for path in workdir.glob("benchmarks/**/*.tsv"):
        kind = next((k for k in KINDS if k in str(path.relative_to(workdir))), None)
        if kind is not None:
            with open(path) as handle:
                totals[kind] += sum(float(row["s"]) for row in csv.DictReader(handle, delimiter="\t"))
    return {k: round(v, 1) for k, v in totals.items()}


def run(workdir: Path, cfg: dict[str, Any], cores: int) -> dict[str, Any]:
    """One real workflow run; its wall time, jobs and tiles."""
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    command += ["--configfile", str(workdir / "config.yaml"), "--cores", str(cores)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"workflow failed in {workdir}:\n{result.stderr[-4000:]}")
    outputs = RunPaths(default_model_name("detection", cfg["model"]["file"])).root  # no model.name: the file's stem
    profiles = [json.loads(p.read_text()) for p in workdir.glob(f"{outputs}/*/predict_profile.json")]
    jobs = sum(1 for _ in workdir.glob("benchmarks/predict/**/*.tsv"))
    return {
        "wall_s": round(wall, 1),
        "scenes": len(profiles),
        "tiles": sum(p["total"]["tiles"] for p in profiles),
        "predict_jobs": jobs,
        "job_s": job_seconds(workdir),
    }


def scenes_dir(root: Path, count: int, side: int) -> Path:
    """``count`` rasters of side x side (one written, the rest copies: timings do not depend on pixel values)."""
    folder = root / "rasters"
    folder.mkdir(parents=True)
    first = write_raster(folder / "scene_000.tif", side)
    for index in range(1, count):
        shutil.copyfile(first, folder / f"scene_{index:03d}.tif")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", type=int, default=200)
    parser.add_argument(
        "--side", type=int, default=400, help="side of each small scene in pixels (1024: the full size)"
    )
    parser.add_argument("--scenes-per-job", type=int, default=64)
    parser.add_argument("--per-scene", type=int, default=20, help="scenes of the one-job-per-scene run (0: skip)")
    parser.add_argument("--devices", type=int, default=1, help="predict.devices")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "results/bench_scenes.json"))
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    per_scene = min(args.per_scene, args.scenes)
    big = round(args.side * math.sqrt(args.scenes))
    results: dict[str, Any] = {
        "sizes": {"scenes": args.scenes, "side": args.side, "single_side": big, "per_scene_scenes": per_scene},
        "config": config(Path("model.pt"), "...", args.scenes_per_job, args.devices),
    }
    with tempfile.TemporaryDirectory(prefix="rasterscale-scenes-", dir=args.workdir) as tmp:
        root = Path(tmp)
        model_file = write_detector(root / "model.pt", backbone="resnet18", patch_size=400)
        single = root / "single"
        (single / "rasters").mkdir(parents=True)
        write_raster(single / "rasters/mosaic.tif", big)
        many = root / "batched"
        scenes_dir(many, args.scenes, args.side)
        runs = {"single": (single, {"mosaic": {"path": "rasters/mosaic.tif"}}, args.scenes_per_job)}
        runs["batched"] = (many, "rasters/*.tif", args.scenes_per_job)
        if per_scene:
            old = root / "per_scene"
            old.mkdir()
            (old / "rasters").mkdir()
            for path in sorted((many / "rasters").glob("*.tif"))[:per_scene]:
                (old / "rasters" / path.name).symlink_to(path)
            runs["per_scene"] = (old, "rasters/*.tif", 1)
        for name, (workdir, scenes, per_job) in runs.items():
            results[name] = run(workdir, config(model_file, scenes, per_job, args.devices), args.cores)
            print(f"{name}: {results[name]}", flush=True)
    base = results["single"]
    lines = [
        f"many scenes vs one: {args.scenes} scenes of {args.side}x{args.side} px vs one of {big}x{big} px, "
        f"resnet18 at native scale, `snakemake --cores {args.cores}`, predict.devices {args.devices}",
        f"{'run':<10} {'scenes':>6} {'tiles':>6} {'jobs':>5} {'wall s':>7} {'x single':>8} {'s/tile':>7} "
        f"{'x single':>8}  job s (manifest / predict / merge)",
    ]
    for name in ("single", "batched", "per_scene"):
        if name not in results:
            continue
        r = results[name]
        per_tile = r["wall_s"] / max(r["tiles"], 1)
        base_tile = base["wall_s"] / max(base["tiles"], 1)
        job = r["job_s"]
        lines.append(
            f"{name:<10} {r['scenes']:>6} {r['tiles']:>6} {r['predict_jobs']:>5} {r['wall_s']:>7.1f} "
            f"{r['wall_s'] / base['wall_s']:>8.2f} {per_tile:>7.3f} {per_tile / base_tile:>8.2f}  "
            f"{job['tiles']:.1f} / {job['predict']:.1f} / {job['merge']:.1f}"
        )
    if "per_scene" in results and per_scene < args.scenes:
        extrapolated = results["per_scene"]["wall_s"] * args.scenes / per_scene
        lines.append(
            f"per_scene over all {args.scenes} scenes (its wall x {args.scenes}/{per_scene}): ~{extrapolated:.0f} s, "
            f"{extrapolated / base['wall_s']:.1f}x single, {extrapolated / results['batched']['wall_s']:.1f}x batched"
        )
    table = "\n".join(lines)
    results["table"] = table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
