"""make bench-gpu's CPU run (bench/gpu.py --cpu): the GPU acceptance run's own code on tiny sizes, so that it never
rots on machines without a GPU. It runs the real training and prediction jobs; a minute or two on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import snakemake_forks
from conftest import REPO
from rasterscale.grid.manifest import tile_grid
from rasterscale.runtime import precision as precisions

sys.path.insert(0, str(REPO / "bench"))

from gpu import format_table
from gpu_measures import CPU, SECTIONS, attempt, chosen_sections, make_bench, run_sections

NAMES = [name for name, _ in SECTIONS]


@pytest.fixture(scope="module")
def bench_gpu(tmp_path_factory):
    """The CPU run's JSON, its table file and what it printed."""
    workdir = tmp_path_factory.mktemp("bench-gpu")
    out = workdir / "bench-gpu.json"
    zygote = snakemake_forks.job_zygote()  # the bench and its jobs forked from it (tests/job_forks.py)
    python, env = (sys.executable, None) if zygote is None else (str(zygote.client), zygote.environment())
    command = [python, str(REPO / "bench/gpu.py"), "--cpu", "--out", str(out), "--workdir", str(workdir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text()), out.with_suffix(".txt").read_text(), result.stdout


@pytest.mark.slow
def test_every_section_ran_without_error(bench_gpu):
    result, _, _ = bench_gpu
    assert result["mode"] == "cpu"
    assert list(result["sections"]) == NAMES
    for name, section in result["sections"].items():
        assert "error" not in section, (name, section.get("traceback"))
        for precision, run in section.get("runs", {}).items():
            assert "error" not in run, (name, precision, run.get("traceback"))


@pytest.mark.slow
def test_the_table_shows_every_section_and_rank(bench_gpu):
    result, table, printed = bench_gpu
    assert table.strip() in printed
    lines = table.splitlines()
    assert lines[0].startswith("rasterscale bench-gpu (cpu)")
    for name in NAMES:
        assert any(line.startswith(f"{name} ") for line in lines), name
    for rank in range(result["ranks"]):
        for precision in ("auto", "32-true"):
            assert any(line.startswith("predict") and f"rank {rank} ({precision}" in line for line in lines)
    assert not [line for line in lines if " error " in line or "not run" in line or "unreadable" in line]
    auto = result["auto"]
    assert any(line.startswith("train") and f"auto ({auto})" in line for line in lines)
    assert any(line.startswith("predict") and f"auto ({auto})" in line for line in lines)


@pytest.mark.slow
def test_figures_are_measured(bench_gpu):
    result, _, _ = bench_gpu
    sections = result["sections"]
    for run in sections["train"]["runs"].values():
        assert run["steps"] == CPU.train_steps
        assert run["steps_per_s"] > 0 and run["images_per_s"] > 0 and run["job_wall_s"] > run["fit_s"] > 0
        assert {"val_precision", "val_recall", "val_f1", "val_map50"} <= set(run["validation"])  # rank 0's, once
    side = CPU.predict_side * CPU.predict_repeats  # the synthesized scene repeated: every tile predicted once
    for run in sections["predict"]["runs"].values():
        assert run["tiles"] == len(tile_grid(side, side, CPU.patch, CPU.overlap))
        assert run["tiles_per_s"] > 0 and run["job_wall_s"] > 0 and 0 <= run["wait_fraction"] < 1
    scaling = sections["predict"]["scaling"]  # 2 CPU ranks against one
    assert scaling["ranks"] == CPU.cpu_ranks and scaling["one_rank_tiles_per_s"] > 0 and scaling["speedup"] > 0
    forward = sections["forward"]
    assert set(forward["tiles_per_s"]) == {str(batch) for batch in CPU.forward_batches}
    assert all(rate > 0 for rate in forward["tiles_per_s"].values())
    assert forward["job_over_forward"] > 0
    assert forward["fp32_tiles_per_s"][str(max(CPU.forward_batches))] > 0 and forward["auto_over_fp32"] > 0
    assert forward["precision_agreement"]["reference"] > 0  # fp32's boxes, against auto's
    runs, auto = sections["compile"]["runs"], result["auto"]
    assert set(runs) == {f"default @ {precision}" for precision in dict.fromkeys((auto, "32-true"))}
    for compiled in runs.values():
        assert compiled["backend"] == "eager" and compiled["speedup"] > 0
        assert compiled["tiles_per_s"]["eager"] > 0 and compiled["tiles_per_s"]["compiled"] > 0
        assert compiled["agreement"]["reference"] > 0 and compiled["agreement"]["same_boxes"]  # the eager backend
    instances = sections["instances"]  # Mask R-CNN's job, every tile predicted once, against its pure forward
    assert instances["tiles"] == len(tile_grid(side, side, CPU.patch, CPU.overlap))
    assert instances["forward_tiles_per_s"] > 0 and instances["job_over_forward"] > 0
    dense = sections["dense"]
    assert set(dense["ceiling"]["rows"]) == {"segmentation/workers=auto", "regression/workers=auto"}
    for row in dense["ceiling"]["rows"].values():  # the null model's job, its stages adding up to its rank's wall
        assert row["tiles_per_s"] > 0 and sum(row["stages"].values()) == pytest.approx(row["rank_wall_s"], abs=0.01)
    unet = dense["unet"]
    assert unet["batch"] == CPU.unet_batch and unet["forward_tiles_per_s"] > 0 and unet["job_over_forward"] > 0
    copy = sections["copy"]
    assert copy["gb_per_s"]["pageable"] > 0 and copy["gb_per_s"]["pinned"] is None  # pinning needs CUDA
    assert copy["job_wait_fraction"] == sections["predict"]["runs"]["auto"]["wait_fraction"]


@pytest.mark.slow
def test_every_rank_records_the_precision_auto_resolves_to(bench_gpu):
    result, _, _ = bench_gpu
    auto = precisions.choose(precisions.probe("cpu"))
    assert result["auto"] == auto
    train = result["sections"]["train"]["runs"]
    assert train["auto"]["precision"] == auto and train["32-true"]["precision"] == precisions.FP32
    for requested, expected in (("auto", auto), ("32-true", precisions.FP32)):
        run = result["sections"]["predict"]["runs"][requested]
        assert run["precision"] == expected
        ranks = run["ranks"]
        assert [rank["rank"] for rank in ranks] == list(range(CPU.cpu_ranks))
        for rank in ranks:
            assert rank["precision"] == expected
            assert rank["device"] == "cpu" and rank["tiles"] > 0 and rank["tiles_per_s"] > 0
            assert rank["utilization_source"] == "cpu_time" and rank["utilization"] > 0
            assert rank["memory_kind"] == "host_rss" and rank["memory_peak_mb"] > 0


def test_a_failed_or_missing_section_is_a_row_of_its_own():
    """Fail soft: a section's error is its result, and the table shows it beside the others."""
    failed = attempt(lambda: {"value": 1 / 0})
    assert failed["error"].startswith("ZeroDivisionError") and "traceback" in failed
    result = {
        "mode": "gpu",
        "ranks": 1,
        "auto": "bf16-mixed",
        "machine": {"gpus": ["a GPU"], "cuda": "13.0", "torch": "2", "nvml": {"error": "NVMLError: none"}},
        "sizes": {},
        "sections": {"train": failed, "predict": {"runs": {"auto": {"error": "RuntimeError: job failed"}}}},
    }
    lines = format_table(result).splitlines()
    assert any(line.startswith("train") and "ZeroDivisionError" in line for line in lines)
    assert any(line.startswith("predict") and "RuntimeError: job failed" in line for line in lines)
    assert sum("not run" in line for line in lines) == len(NAMES) - 2


def test_only_the_sections_asked_for_run_and_an_unknown_one_is_refused(tmp_path):
    """``bench/gpu.py --sections``: a rerun on a lent GPU measures what it names, in the bench's order."""
    results = run_sections(make_bench(tmp_path, cpu=True), names=["copy"])
    assert list(results) == ["copy"] and "error" not in results["copy"] and results["copy"]["gb_per_s"]["pageable"] > 0
    with pytest.raises(ValueError, match="no bench-gpu section trian: the sections are dense, train, predict"):
        chosen_sections(["copy", "trian"])
    assert chosen_sections(None) == NAMES and chosen_sections(["copy", "dense"]) == ["dense", "copy"]
