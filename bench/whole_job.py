"""The whole job, not only the rank: a null-model run of the workflow (`snakemake --cores 2`) and where its wall goes.

The null model of bench/host_ceiling.py (a TorchScript 1x1 convolution with its card: 2 class logits for
segmentation, 1 value for regression) predicts a ``side`` x ``side`` RGB scene (256 px tiles, overlap 32) on one
rank, in a fresh working directory, through every rule a run of one predicted scene runs: its tile manifest, the
prediction, the merge (segmentation: classes.tif, probabilities.tif and classes.gpkg; regression: values.tif), the
scoring (the quicklook, the report's pages) and the report's run page and project map. Each rule's wall comes from
Snakemake's benchmark files (the job's process, start to exit); the rank's prediction wall from the scene's predict
profile; ``after_rank_s`` is the run's wall after the last rank record was written (the prediction process's exit,
the merge, the scoring, the report and Snakemake's own work between them).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # run alone: python bench/whole_job.py
sys.path.insert(0, str(REPO / "bench"))

from host_ceiling import OVERLAP, PATCH, write_null_model  # noqa: E402
from rasterscale.config.schema import default_model_name  # noqa: E402
from rasterscale.jobs.paths import RunPaths  # noqa: E402
from synthetic import write_raster  # noqa: E402

BATCH = 32
# the rule of each benchmark file, by the folder or file it is in (rules/*.smk's benchmark directives)
RULES = {
    "tiles": "tiles",
    "predict": "predict",
    "merge": "merge",
    "score": "score",
    "report/run_page": "report_run_page",
    "report/project_map": "report_project_map",
}


def whole_job_config(task: str, raster: Path, model: Path, probabilities: bool = True) -> dict[str, Any]:
    """One scene predicted with the null model on one CPU rank, nothing trained (segmentation: its probabilities
    too when ``probabilities``)."""
    predict: dict[str, Any] = {"scenes": ["scene"], "accelerator": "cpu", "devices": 1, "workers": 1}
    predict["batch_size"] = BATCH
    if task == "segmentation":
        predict["probabilities"] = probabilities
    return {
        "task": task,
        "scenes": {"scene": {"path": str(raster)}},
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        "model": {"file": str(model)},
        "train": {"scenes": []},
        "predict": predict,
    }


def rule_seconds(workdir: Path) -> dict[str, float]:
    """Each rule's wall seconds (its benchmark files, summed over its jobs)."""
    seconds: dict[str, float] = {}
    for path in sorted(workdir.glob("benchmarks/**/*.tsv")):
        where = str(path.relative_to(workdir / "benchmarks").with_suffix(""))
        rule = next((name for key, name in RULES.items() if where.startswith(key)), where)
        with open(path) as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        seconds[rule] = seconds.get(rule, 0.0) + sum(float(row["s"]) for row in rows)
    return {rule: round(value, 2) for rule, value in seconds.items()}


def run_workflow(workdir: Path, config: dict[str, Any], cores: int, timeout: float) -> float:
    """The real workflow on ``config`` in ``workdir``; its wall seconds, start to exit."""
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    command += ["--configfile", str(workdir / "config.yaml"), "--cores", str(cores)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(workdir.glob("logs/**/*.log")))
        raise RuntimeError(f"workflow failed in {workdir}:\n{result.stderr[-4000:]}\n{logs}")
    return wall


def measure_whole_job(
    workdir: Path, task: str = "segmentation", side: int = 6144, cores: int = 2, timeout: float = 1800
) -> dict[str, Any]:
    """A null-model run of the workflow of ``task`` over a ``side`` px scene in ``workdir`` (made fresh): the
    whole wall, the rank's prediction wall, each rule's wall, the wall after the rank and the share of the wall
    outside the rank's prediction."""
    workdir.mkdir(parents=True, exist_ok=True)
    raster = write_raster(workdir / "scene.tif", side)
    model = write_null_model(workdir / f"null-{task}.pt", task)
    config = whole_job_config(task, raster, model)
    run = workdir / "run"
    run.mkdir()
    started = time.time()
    wall = run_workflow(run, config, cores, timeout)
    ended = started + wall
    outputs = run / RunPaths(default_model_name(task, str(model))).root
    profile = json.loads((outputs / "scene/predict_profile.json").read_text())
    rank_ended = max(path.stat().st_mtime for path in outputs.glob("predict/batch-*/shard-*/scene/rank-*.json"))
    rank_wall = float(profile["total"]["wall_s"])
    return {
        "task": task,
        "side": side,
        "tiles": profile["total"]["tiles"],
        "cores": cores,
        "wall_s": round(wall, 2),
        "rank_wall_s": round(rank_wall, 2),
        "rules_s": rule_seconds(run),
        "after_rank_s": round(ended - rank_ended, 2),
        "outside_rank": round(1 - rank_wall / wall, 3),
        "model": f"null model (TorchScript 1x1 conv), {PATCH} px tiles, overlap {OVERLAP}, batch {BATCH}, 1 rank",
    }


def main() -> None:
    """The measure alone: JSON to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["segmentation", "regression"], nargs="+", default=["segmentation"])
    parser.add_argument("--side", type=int, default=6144)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="whole-job-", dir=args.workdir) as tmp:
        for task in args.task:
            results[task] = measure_whole_job(Path(tmp) / task, task, args.side, args.cores)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
