"""The cost estimate a dry run prints (rasterscale.workflow.estimate): its tiles are the tile manifests' own for
unmasked rasters (at most theirs where tiles are masked), its hours are tiles / tiles/s / 3600 at the rates of the
bench results it names (results/throughput.json, as make bench and make bench-gpu write it: bench/throughput.py),
else of the documented defaults; the jobs, nodes and wall time the Slurm profile asks for; and one real
`snakemake -n`, which prints it once."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from affine import Affine

import snakemake_forks
from conftest import REPO, write_raster
from rasterscale.grid.manifest import build_manifest, tile_grid
from rasterscale.jobs.paths import throughput_file
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.workflow.checks import build_plan
from rasterscale.workflow.estimate import estimate_lines, figure, prediction_work, print_estimate
from rasterscale.workflow.throughput import CPU, DEFAULTS, GPU, Throughput, read_throughputs, write_throughput
from workflow import workflow_command

sys.path.insert(0, str(REPO / "bench"))  # the bench's modules import each other by name, as bench/run.py runs them

from throughput import cpu_entry, gpu_entry

PATCH, OVERLAP = 64, 16
H100 = "NVIDIA H100 80GB HBM3"
# results/throughput.json as make bench-gpu (4 GPUs) and make bench (4 cores) write it: 1300 tiles/s and 90 images/s
# per GPU, 2.5 tiles/s per core
BENCH = {
    H100: {
        "kind": "gpu",
        "device": H100,
        "tiles_per_s": 5200.0,
        "devices": 4,
        "ranks": 4,
        "patch_size": 400,
        "overlap": 80,
        "precision": "bf16-mixed",
        "model": "RetinaNet-resnet50, 400 px tiles seen at 800 px, trained (the auto training's)",
        "date": "2026-12-01T10:00:00+00:00",
        "machine": f"gpu01 (4 x {H100})",
        "source": "make bench-gpu",
        "train_images_per_s": 360.0,
        "train_devices": 4,
    },
    "cpu": {
        "kind": "cpu",
        "device": "Intel Xeon Platinum 8480+",
        "tiles_per_s": 10.0,
        "devices": 4,
        "ranks": 1,
        "patch_size": 400,
        "overlap": 80,
        "precision": "bf16-mixed",
        "model": "RetinaNet-resnet50, 400 px tiles",
        "date": "2026-11-30T08:00:00+00:00",
        "machine": "login1 (4 cores)",
        "source": "make bench",
    },
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def project(folder: Path, **sections: dict) -> dict:
    """a and b abut (a seam between them: its tiles read across their border), c lies apart with its left half no
    data; a is annotated and trained on (10 steps of 6 tiles), all three predicted."""
    write_raster(folder / "a.tif", 300, 200)
    write_raster(folder / "b.tif", 250, 200, transform=Affine(0.1, 0, 404030.0, 0, -0.1, 3285000.0))
    data = np.full((3, 150, 200), 90, dtype=np.uint8)
    data[:, :, :100] = 0
    write_raster(
        folder / "c.tif", 200, 150, transform=Affine(0.1, 0, 405000.0, 0, -0.1, 3285000.0), nodata=0, data=data
    )
    (folder / "a.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\na.tif,10,10,50,50,tree\n")
    config = {
        "scenes": {"a": {"path": "a.tif", "annotations": "a.csv"}, "b": {"path": "b.tif"}, "c": {"path": "c.tif"}},
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        "train": {"scenes": ["a"], "validation_fraction": 0.5, "max_steps": 10, "batch_size": 6},
        "predict": {"scenes": "all"},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def write_bench(folder: Path, entries: dict | str = BENCH) -> Path:
    path = folder / throughput_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    return path


def printed(plan, folder: Path) -> list[str]:
    lines: list[str] = []
    print_estimate(plan, lines.append, workdir=folder)
    return lines


def alternative(line: str, unit: str, what: str, device: str, provenance: str) -> tuple[str, float]:
    """The printed hours and rate of one alternative of a line."""
    pattern = (
        rf"≈ ([\d.,]+) {unit} at ([\d.,]+) {what}/s \(400 px\) per {re.escape(device)} \({re.escape(provenance)}\)"
    )
    found = re.search(pattern, line)
    assert found, line
    return found.group(1), float(found.group(2).replace(",", ""))


def test_tiles_are_the_tile_manifests_own_and_at_most_theirs_where_tiles_are_masked(workdir):
    plan = build_plan(project(workdir))
    work = prediction_work(plan)
    assert [seam.name for seam in plan.seams] == ["a+b"] and (work.scenes, work.seams, work.uncounted) == (3, 1, 0)
    for name in ("a", "b"):
        assert work.tiles[name] == len(build_manifest(workdir / f"{name}.tif", PATCH, OVERLAP)), name
    seam = plan.seams[0]
    mosaic = write_mosaic(workdir / "mosaic.vrt", [workdir / "a.tif", workdir / "b.tif"])
    assert work.tiles["a+b"] == len(build_manifest(mosaic, PATCH, OVERLAP, core=seam.core)) > 0
    masked = len(build_manifest(workdir / "c.tif", PATCH, OVERLAP))
    assert work.tiles["c"] == len(build_manifest(workdir / "c.tif", PATCH, OVERLAP, skip_nodata=False)) > masked
    assert work.total == sum(work.tiles.values())


def test_a_demo_scene_not_made_yet_counts_by_its_demo_size(workdir):
    config = project(workdir, demo={"scenes": {"d": {"width": 500, "height": 300, "seed": 1}}})
    config["scenes"]["d"] = {"path": "resources/demo/d.tif"}
    work = prediction_work(build_plan(config))
    assert work.tiles["d"] == len(tile_grid(500, 300, PATCH, OVERLAP)) and (work.scenes, work.uncounted) == (4, 0)


def test_the_lines_give_the_hours_at_the_bench_results_they_name(workdir):
    write_bench(workdir)
    plan = build_plan(project(workdir))
    total = prediction_work(plan).total
    predict, train = printed(plan, workdir)
    assert predict.startswith(f"plan: predict: 3 scenes and 1 seam, at most {total:,} tiles ({PATCH} px, overlap 16): ")
    hours, rate = alternative(
        predict, "GPU-hours", "tiles", H100, f"from make bench-gpu on gpu01 (4 x {H100}), 2026-12-01"
    )
    assert rate == 1300 and hours == figure(total / rate / 3600)
    assert float(hours) == pytest.approx(total / 1300 / 3600, rel=5e-3)
    hours, rate = alternative(
        predict,
        "CPU core-hours",
        "tiles",
        "core of Intel Xeon Platinum 8480+",
        "from make bench on login1 (4 cores), 2026-11-30",
    )
    assert rate == 2.5 and hours == figure(total / rate / 3600)
    assert train.startswith("plan: train: at most 10 steps x 6 images (effective batch) = 60 images: ")
    hours, rate = alternative(
        train, "GPU-hours", "images", H100, f"from make bench-gpu on gpu01 (4 x {H100}), 2026-12-01"
    )
    assert rate == 90 and hours == figure(60 / rate / 3600)
    assert train.endswith("or on CPUs unknown (no bench has measured training there)")


def test_without_bench_results_the_documented_defaults_are_used_and_said_so(workdir):
    plan = build_plan(project(workdir, train={"max_steps": -1, "epochs": 3}))
    total = prediction_work(plan).total
    predict, train = printed(plan, workdir)
    default = DEFAULTS[GPU]
    provenance = "documented default: make bench-gpu on one NVIDIA H200 (docs/performance.md), 2026-11-26"
    hours, rate = alternative(predict, "GPU-hours", "tiles", "NVIDIA H200", provenance)
    assert rate == pytest.approx(default.per_device, rel=5e-3) and hours == figure(total / default.per_device / 3600)
    assert "per core of AMD EPYC (documented default: make bench on 2 cores of an AMD EPYC" in predict
    assert train == (
        "plan: train: 3 epochs of the training tiles, 6 images a step (effective batch): time unknown until their "
        "tile manifests are made (set train.max_steps to bound it)"
    )
    for unreadable in ("{not json", json.dumps({"cpu": {**BENCH["cpu"], "tiles_per_s": "fast"}}), "[]"):
        write_bench(workdir, unreadable)
        note, predict, _ = printed(plan, workdir)
        assert note.startswith(f"plan: {workdir / throughput_file()}: not a throughput file (") and note.endswith(
            "): documented defaults used"
        )
        assert provenance in predict


def test_with_slurm_the_jobs_nodes_and_wall_time_the_profile_asks_for(workdir):
    slurm = {"launcher": "srun", "gres": "gpu", "predict_runtime": 90, "train_runtime": 600}
    predict = {"devices": 2, "shards": 3, "scenes_per_job": 1}
    plan = build_plan(project(workdir, slurm=slurm, predict=predict, train={"devices": 2, "nodes": 2}))
    entries = read_throughputs(write_bench(workdir))
    work = prediction_work(plan)
    lines = estimate_lines(plan, entries)
    assert [line.split(": ")[1] for line in lines] == ["predict", "train", "slurm", "slurm"]
    jobs, batches = 3 * len(plan.batches), len(plan.batches)
    largest = max(sum(work.tiles[scene.name] for scene in batch.scenes) for batch in plan.batches)
    assert lines[2] == (
        f"plan: slurm: predict: {jobs} jobs ({batches} batches x 3 shards) of 1 node x 2 GPUs, 90 min each"
        f" (slurm.predict_runtime): at most {figure(jobs * 90 / 60)} node-hours; the largest ≈"
        f" {figure(largest / 3 / (2 * 1300) / 60)} min at 1,300 tiles/s per GPU"
    )
    assert lines[3] == (
        "plan: slurm: train: 1 job of 2 nodes x 2 GPUs, 600 min each (slurm.train_runtime): at most 20 node-hours;"
        f" ≈ {figure(10 * 8 / (4 * 90) / 60)} min at 90 images/s per GPU"  # 4 ranks of 2 tiles: 8 a step
    )
    slow = {H100: Throughput(**{**BENCH[H100], "tiles_per_s": 0.001})}
    assert estimate_lines(plan, slow)[2].endswith(
        ", more than its 90 min: raise slurm.predict_runtime or predict.shards"
    )
    local = build_plan(project(workdir, predict=predict))
    assert [line.split(":")[1] for line in estimate_lines(local, entries)] == [" predict", " train"]


def test_the_benches_record_their_entries_and_keep_the_others(tmp_path):
    """make bench's entry from its efficiency job (tiles/s over its rank's threads), make bench-gpu's from its auto
    prediction and training jobs (none from a CPU run); each replaces its own key only."""
    result = {
        "machine": {"cpu": "AMD EPYC", "cores": 2},
        "details": {"efficiency": {"ranks": [{"tiles_per_s": 5.2, "threads": 2, "precision": "bf16-mixed"}]}},
    }
    cpu = cpu_entry(result, 400, 80, "RetinaNet-resnet50, 400 px tiles", date="2026-12-02")
    assert (cpu.key(), cpu.per_device, cpu.ranks, cpu.source) == (CPU, 2.6, 1, "make bench")
    predict = {"tiles_per_s": 282.2, "precision": "bf16-mixed", "ranks": [{}, {}]}
    bench_gpu = {
        "mode": "gpu",
        "machine": {"gpus": ["NVIDIA H200", "NVIDIA H200"]},
        "sizes": {"patch": 400, "overlap": 80},
        "sections": {
            "predict": {"model": "RetinaNet-resnet50", "runs": {"auto": predict}},
            "train": {"runs": {"auto": {"images_per_s": 189.4, "ranks": 2}}},
        },
    }
    gpu = gpu_entry(bench_gpu, date="2026-12-03")
    assert gpu is not None and (gpu.key(), gpu.per_device, gpu.train_per_device) == ("NVIDIA H200", 141.1, 94.7)
    assert gpu_entry({**bench_gpu, "mode": "cpu", "machine": {"gpus": []}}) is None
    failed = {**bench_gpu, "sections": {"predict": {"runs": {"auto": {"error": "RuntimeError: CUDA"}}}}}
    assert gpu_entry(failed) is None
    path = tmp_path / "throughput.json"
    write_throughput(cpu, path)
    write_throughput(gpu, path)
    write_throughput(Throughput(**{**cpu.to_dict(), "tiles_per_s": 6.0}), path)
    entries = read_throughputs(path)
    assert list(entries) == ["NVIDIA H200", CPU] and entries[CPU].tiles_per_s == 6.0 and entries["NVIDIA H200"] == gpu


def test_a_dry_run_prints_each_line_once(tmp_path):
    config = project(tmp_path)
    result = snakemake_forks.run(workflow_command(tmp_path, config, "-n"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale: plan: ")]
    assert [line.split(":")[2] for line in lines] == [" predict", " train"], result.stderr[-3000:]
    assert "3 scenes and 1 seam, at most" in lines[0]
