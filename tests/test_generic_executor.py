"""The launcher seam (rasterscale.runtime.launchers) with an engine other than Slurm: Snakemake's generic cluster
executor (snakemake-executor-plugin-cluster-generic), whose submit command is a script that starts each job on this
machine, as an engine would on a node it gives the job. The DDP step's ranks start as the local launcher starts them
(the job's own process, no srun), its GPUs reach the engine as Snakemake's `gpu` resource, and the layer is what a
local run makes of the same scene: every tile exactly once."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import geopandas as gpd
import pytest

from prediction import PredictScene
from rasterscale.jobs.paths import RunPaths
from snakemake_forks import run as run_snakemake
from workflow import workflow_command

RUN = "model"  # the run's name: its model file's

# The engine: each submission logged as one line of what the job asks for (rule, GPUs, threads, memory), the job
# started in the background as its own session, its id printed back (Snakemake's external job id).
SUBMIT = """#!/bin/bash
set -eu
rule=$1 gpu=$2 threads=$3 mem_mb=$4
jobscript=${@: -1}
engine=$(dirname "$0")
echo "rule=$rule gpu=$gpu threads=$threads mem_mb=$mem_mb" >> "$engine/submitted.log"
setsid bash "$jobscript" > "$engine/job-$rule-$$.log" 2>&1 < /dev/null &
echo "engine-$!"
"""


def scene_config(scene: PredictScene) -> dict:
    """The scene predicted by 2 ranks on their own (devices 2, accelerator auto: they ask for 2 GPUs and run on
    the CPU here)."""
    return {
        "scenes": {"scene": {"path": str(scene.raster)}},
        "model": {"backbone": "resnet18", "file": str(scene.model_file)},
        "tiling": {"patch_size": PredictScene.patch_size, "overlap": PredictScene.overlap},
        "predict": {"scenes": ["scene"], "devices": 2, "workers": 0, "batch_size": 4},
    }


@pytest.mark.slow
def test_a_generic_cluster_executor_runs_the_workflow_and_the_job_starts_its_own_ranks(tmp_path: Path) -> None:
    scene = PredictScene.make(tmp_path / "model")
    engine = tmp_path / "engine"
    engine.mkdir()
    submit = engine / "submit.sh"
    submit.write_text(SUBMIT)
    submit.chmod(submit.stat().st_mode | stat.S_IXUSR)
    workdir = tmp_path / "run"
    merged = RunPaths(RUN).batch_record("merge", 0)
    command = workflow_command(workdir, scene_config(scene))
    command += ["--executor", "cluster-generic", "--jobs", "2", "--seconds-between-status-checks", "1"]
    command += ["--default-resources", "gpu=0", "mem_mb=1000"]
    submitting = f"{submit} {{rule}} {{resources.gpu}} {{threads}} {{resources.mem_mb}}"
    command += ["--cluster-generic-submit-cmd", submitting, merged]
    result = run_snakemake(command, timeout=600)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(engine.glob("job-*.log")))
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{logs}"

    # every job went through the engine: its rule and what it asked for
    submitted = sorted((engine / "submitted.log").read_text().splitlines())
    assert [line.split()[0] for line in submitted] == ["rule=merge_batch_0", "rule=predict", "rule=tiles_batch_0"]
    predict = next(line for line in submitted if line.startswith("rule=predict"))
    assert predict.startswith("rule=predict gpu=2 threads=") and predict.split()[2] != "threads=1", submitted
    for line in (line for line in submitted if line is not predict):  # the CPU steps: no GPU, their estimates
        assert " gpu=0 " in line and int(line.split("mem_mb=")[1]) >= 500, submitted
    ids = re.findall(r"with external jobid 'engine-(\d+)'", result.stdout + result.stderr)
    assert len(ids) == 3, result.stderr[-3000:]

    # the prediction job started its second rank itself (the local launcher: no srun, no Slurm variables)
    job_log = next(engine.glob("job-predict-*.log")).read_text()
    assert "srun" not in job_log
    shard = workdir / RunPaths(RUN).shard_dir(0, 0)
    records = [json.loads((shard / f"scene/rank-{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        assert (workdir / f"logs/predict/batch-0/shard-0/rank-{rank}.log").exists()
    tiles = [tile for record in records for tile in record["tile_ids"]]
    assert sorted(tiles) == list(range(scene.tiles)) and all(record["tile_ids"] for record in records)
    layer = gpd.read_parquet(workdir / RunPaths(RUN).scene_file("scene", "detections.parquet"))
    assert layer.crs is not None and len(layer) > 0
