"""make bench's report, without running the bench: the hardware header (from rasterscale.runtime.precision's capability
of a CPU or GPU), the autocast each precision value runs under, and the table of a whole result."""

import re
import sys

import pytest
import torch

from conftest import REPO
from rasterscale.runtime.precision import AUTO, BF16, FP16, FP32, cpu_capability, cuda_capability

sys.path.append(str(REPO / "bench"))  # the bench's modules import each other by name, as bench/run.py runs them

from hardware import describe, header
from measures import autocast, autocast_dtype
from suite import TARGETS, Sizes, bands_figures, ceiling_figures, format_table, met

AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS_FLAGS = AVX2_FLAGS | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
NO_CAP = (True, "")


def avx2_machine() -> dict:
    return describe(cpu_capability(False, AVX2_FLAGS, "AMD EPYC", NO_CAP), AVX2_FLAGS, 2, "2.9.0")


def test_the_header_of_an_avx2_cpu_says_bf16_is_emulated_and_auto_picks_fp32():
    machine = avx2_machine()
    assert machine["auto"] == FP32 and machine["flags"] == {
        "avx2": True,
        "avx512f": False,
        "avx512_bf16": False,
        "amx_bf16": False,
    }
    first, second = header(machine, 812.4)
    assert first == "rasterscale bench: AMD EPYC, 2 cores, torch 2.9.0, GPU none; 812 s"
    assert second == (
        "CPU flags: avx2 yes, avx512f no, avx512_bf16 no, amx_bf16 no; oneDNN bf16 no; no avx512_bf16/amx_bf16:"
        " bf16 emulated, precision auto picks 32-true on this CPU"
    )


def test_the_header_of_a_bf16_cpu_with_a_gpu_names_both():
    cpu = cpu_capability(True, SAPPHIRE_RAPIDS_FLAGS, "Xeon 8480", NO_CAP)
    machine = describe(cpu, SAPPHIRE_RAPIDS_FLAGS, 16, "2.9.0", cuda_capability(9, 0, "NVIDIA H100"))
    assert machine["auto"] == BF16 and machine["gpu_auto"] == BF16 and all(machine["flags"].values())
    first, second = header(machine, 60)
    assert "GPU NVIDIA H100 (compute capability 9.0, auto picks bf16-mixed; the bench runs on the CPU)" in first
    assert "bf16 native, precision auto picks bf16-mixed on this CPU" in second


def test_autocast_maps_every_resolved_precision_as_lightning_does():
    assert autocast_dtype(FP32) is None and autocast_dtype(FP32, "cuda") is None
    assert autocast_dtype(BF16) == torch.bfloat16 and autocast_dtype(BF16, "cuda") == torch.bfloat16
    assert autocast_dtype(FP16, "cuda") == torch.float16
    assert autocast_dtype(FP16) == torch.bfloat16  # a CPU has no fp16 autocast: Lightning runs bf16-mixed
    with pytest.raises(ValueError, match="resolve auto first"):
        autocast_dtype(AUTO)
    with autocast(FP32):
        assert not torch.is_autocast_enabled("cpu")
    for value in (BF16, FP16):
        with autocast(value):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def bench_result(machine: dict) -> dict:
    """A whole result of run_bench, with made-up figures."""
    auto = machine["auto"]
    job = {"job_wall_s": 100.0, "tiles": 1024, "ranks": []}
    seg = {
        "rank_rss_peak_mb": 1150.0,
        "rank_rss_peaks_mb": [1140.0, 1150.0, 1160.0],
        "merge_rss_peak_mb": 330.0,
        "predicted_tiles": 169,
        "tile_rows": 13,
        "job_wall_s": 60.0,
        "merge_wall_s": 19.0,
    }
    details = {
        "efficiency": {
            "efficiency": 0.85,
            "forward_s": 90.0,
            "job_wall_s": 105.9,
            "tiles": 1024,
            "in_loop_efficiency": 0.9,
            "in_loop": {
                "compute_over_forward_s": 1.0,
                "output_s": 0.0,
                "wait_s": 1.1,
                "workers0_in_loop_efficiency": 0.88,
            },
            "startup_and_write_s": 6.0,
            "precision": auto,
        },
        "fastpath": {
            "speedup": 1.6,
            "baseline_s_per_tile": 0.3,
            "fast_s_per_tile": 0.1875,
            "threads": 2,
            "precision": auto,
        },
        "precision": {
            "auto": auto,
            "fp32_s_per_tile": 0.19,
            "bf16_s_per_tile": 13.3,
            "bf16_over_fp32": 70.0,
            "fp32_tiles": 4,
            "bf16_tiles": 4,
            "batch_size": 4,
            "gflop_per_tile": 63.3,
            "fp32_gflops_per_thread": 166.6,
            "bf16_gflops_per_thread": 2.4,
        },
        "scaling": {
            "scaling": 1.8,
            "throughput_scaling": 1.95,
            "one_rank": {**job, "job_wall_s": 190.0},
            "two_ranks": {**job, "job_wall_s": 105.6},
        },
        "rss": {"4096": {"rss_peak_mb": 1150.0, "predicted_tiles": 24, "manifest_tiles": 169}},
        "merge": {"seconds": 6.0, "boxes": 998_836, "tiles": 15_625, "kept": 640_000},
        "manifest": {"seconds": 0.2, "tiles": 97_969},
        "points": {
            "seconds": 7.8,
            "ranks_s": 4.9,
            "merge_s": 2.9,
            "merge_job_s": 36.0,
            "points": 1_000_000,
            "decoded": 1_593_309,
            "kept": 1_000_000,
            "tiles": 15_625,
        },
        "points_job": {
            "points": {"tiles": 289, "tiles_per_s": 5.9, "points": 23_000, "points_per_s": 466.0},
            "segmentation": {"tiles": 289, "tiles_per_s": 4.4},
            "points_vs_segmentation": 1.34,
            "side": 4096,
            "model": "U-Net on resnet18, 256 px",
        },
        "segmentation": {"4096": seg, "32768": {**seg, "rank_rss_peak_mb": 1140.0, "merge_rss_peak_mb": 315.0}},
        "regression": {
            "4096": {**seg, "rank_rss_peak_mb": 1100.0, "merge_rss_peak_mb": 250.0},
            "32768": {**seg, "rank_rss_peak_mb": 1110.0, "merge_rss_peak_mb": 270.0, "merge_wall_s": 70.0},
        },
        "instances_rank": {
            side: {"rss_peak_mb": mb, "tiles": 24, "instances": 2400, "job_wall_s": 30.0}
            for side, mb in (("4096", 1450.0), ("32768", 1465.0))
        },
        "instances": {
            "merge": {
                "seconds": 40.0,
                "cpu_s": 39.0,
                "all_cores": {"cores": 2, "seconds": 30.0, "cpu_s": 41.0},
                "rss_peak_mb": 2400.0,
                "crowns": 625_000,
                "instances": 1_013_551,
                "cut": 154_380,
                "tiles": 15_625,
                "vertices_mean": 29.9,
                "drawn": 650_000,
                "side": 40_000,
            },
            "rss": {
                side: {"seconds": 1.0, "rss_peak_mb": mb, "crowns": 14_000, "instances": 23_000, "drawn": 15_000}
                for side, mb in (("4096", 300.0), ("32768", 310.0))
            },
        },
    }
    details["bands"] = bands_details()
    details["exported"] = exported_details()
    details["host_ceiling"] = ceiling_details()
    details["whole_job"] = {
        "task": "segmentation",
        "tiles": 784,
        "cores": 2,
        "wall_s": 21.3,
        "rank_wall_s": 1.6,
        "rules_s": {"tiles_batch_0": 2.1, "predict_batch_0": 5.2, "merge_batch_0": 6.9},
        "after_rank_s": 12.0,
        "outside_rank": 0.925,
        "model": "null model",
    }
    for section in details.values():
        section["load_1min"] = [1.0, 1.5]
    figures = {
        "efficiency": 0.85,
        "fastpath_speedup": 1.6,
        "scaling_2v1": 1.8,
        "rss_mb": {"4096": 1150.0},
        "merge_1m_s": 6.0,
        "manifest_100k_s": 0.2,
        "points_merge_1m_s": 7.8,
        "points_job_vs_segmentation": 1.34,
        "seg_rank_rss_mb": {"4096": 1150.0, "32768": 1140.0},
        "seg_merge_rss_mb": {"4096": 330.0, "32768": 315.0},
        "seg_rank_rss_growth": 0.991,
        "seg_merge_rss_growth": 0.955,
        "regression_rank_rss_mb": {"4096": 1100.0, "32768": 1110.0},
        "regression_merge_rss_mb": {"4096": 250.0, "32768": 270.0},
        "regression_rank_rss_growth": 1.009,
        "regression_merge_rss_growth": 1.08,
        "instances_merge_1m_s": 40.0,
        "instances_merge_rss_growth": 1.033,
        "instances_rank_rss_growth": 1.01,
        **bands_figures(details["bands"]),
        "exported_efficiency": {form: run["efficiency"] for form, run in details["exported"]["forms"].items()},
        "host_ceiling_tiles_per_s": ceiling_figures(details["host_ceiling"]),
    }
    agreement = {
        "model_file": "crowns.pt",
        "tiles": 64,
        "score_threshold": 0.3,
        "min_iou": 0.9,
        "precision": auto,
        "fp32": 2000,
        "fast": 2000,
        "fp32_matched_fraction": 1.0,
        "fast_matched_fraction": 1.0,
        "score_abs_diff_mean": 0.0,
        "score_abs_diff_max": 0.0,
        "unmatched_near_threshold": 0,
    }
    return {
        **figures,
        "targets": {name: {"target": f"{c} {t}", "met": met(name, figures[name])} for name, (c, t) in TARGETS.items()},
        "agreement": agreement,
        "details": details,
        "machine": machine,
        "sizes": {"batch_size": Sizes().batch_size},
        "bench_wall_s": 812.4,
    }


def exported_details() -> dict:
    """bench/exported.py's result, with made-up figures: ONNX fastest, torch.export below the target."""

    def run(tiles_per_s: float, efficiency: float, precision: str) -> dict:
        return {
            "tiles_per_s": tiles_per_s,
            "job_wall_s": 100.0,
            "forward_s": efficiency * 100,
            "efficiency": efficiency,
            "precision": precision,
            "tiles": 1024,
        }

    return {
        "forms": {
            "eager": run(10.2, 0.93, "bf16-mixed"),
            "onnx": run(11.5, 0.94, "32-true (its own dtype)"),
            "torch.export": run(4.1, 0.88, "32-true (its own dtype)"),
            "torchscript": run(9.9, 0.92, "bf16-mixed"),
        },
        "fastest": "onnx",
        "auto": "bf16-mixed",
        "model": "U-Net on resnet18 (segmentation), 256 px tiles, batch 4, 1 rank",
        "side": 7168,
    }


def bands_details() -> dict:
    """bench/many_bands.py's result, with made-up figures."""

    def run(tiles_per_s: float, read: float, first_conv: float, rest: float, gflop: float, conv: float) -> dict:
        return {
            "tiles_per_s": tiles_per_s,
            "read_s_per_tile": read,
            "input_s_per_tile": 0.01,
            "first_conv_s_per_tile": first_conv,
            "rest_s_per_tile": rest,
            "gflop_per_tile": gflop,
            "first_conv_gflop_per_tile": conv,
            "dtype": "float32 raw" if conv > 3 else "uint8 scaled",
            "throughput_vs_3": round(tiles_per_s / 2.5, 3),
            "rest_vs_3": round(rest / 0.37, 3),
        }

    read = {"pixel_s": 0.6, "pixel_mb_per_s": 58.2, "band_mb_per_s": 342.6}
    return {
        "throughput": {
            "bands": {
                "3": run(2.5, 0.003, 0.013, 0.37, 17.94, 0.81),
                "4": run(2.45, 0.003, 0.015, 0.37, 18.21, 1.09),
                "13": run(2.15, 0.013, 0.038, 0.376, 20.66, 3.53),
            },
            "model": "untrained U-Net ResNet-18, 400 px, fp32, batch norms folded, channels_last",
            "tiles": 4,
            "batch_size": 4,
            "threads": 2,
            "rounds": 4,
        },
        "interleave": {
            "four": {**read, "bands": [4, 3, 2, 8], "band_s": 0.1, "band_over_pixel": 0.167},
            "all": {**read, "bands": list(range(1, 14)), "band_s": 0.66, "band_over_pixel": 1.1},
            "side": 2048,
            "tiles": 49,
            "block": 256,
            "pixel_file_mb": 95.8,
            "band_file_mb": 90.7,
            "read_cache_mb": 16,
            "rounds": 3,
        },
    }


def test_the_table_names_the_hardware_the_auto_fast_path_and_the_precision_row():
    lines = format_table(bench_result(avx2_machine())).splitlines()
    assert lines[0].startswith("rasterscale bench: AMD EPYC, 2 cores") and "precision auto picks 32-true" in lines[1]
    fastpath = next(line for line in lines if line.startswith("auto (32-true) fast path vs fp32 batch 1"))
    assert ">= 2.5" in fastpath and " NO " in fastpath
    precision = next(line for line in lines if line.startswith("bf16 / fp32 fast path time"))
    assert "70.00x" in precision
    assert "fp32 0.190 s/tile (4 tiles), bf16 autocast 13.300 s/tile (4 tiles), b4;" in precision
    assert "63.3 GFLOP a tile: fp32 166.6, bf16 2.4 GFLOPS a thread; auto picks 32-true" in precision
    assert "(bf16 emulated: oneDNN bf16 no; no avx512_bf16/amx_bf16)" in precision
    assert any("of 2000 auto (32-true) fast-path boxes" in line for line in lines)
    crowns = next(line for line in lines if line.startswith("merge 1M crowns"))
    assert "40.0 s" in crowns and "<= 60.0" in crowns and "1013551 instances" in crowns
    assert "30.0 s on 2 cores" in crowns
    assert any(line.startswith("instances merge RSS 32k^2/4k^2") and "1.033x" in line for line in lines)
    assert any(line.startswith("instances rank RSS 32k^2/4k^2") and "1.010x" in line for line in lines)
    thirteen = next(line for line in lines if line.startswith("throughput 13 / 3 bands"))
    assert "0.86x" in thirteen and ">= 0.7" in thirteen and " yes " in thirteen
    assert "2.50 -> 2.15 tiles/s (float32 raw)" in thirteen and "first conv 0.013 -> 0.038" in thirteen
    rest = next(line for line in lines if line.startswith("rest of the network 13 / 3 bands"))
    assert "1.016x" in rest and "<= 1.1" in rest and "GFLOP 17.13 -> 17.13" in rest
    assert "read +0.010 s, input +0.000 s, first conv +0.025 s (0.81 -> 3.53 GFLOP)" in rest
    assert any(line.startswith("throughput 4 / 3 bands") and "0.98x" in line for line in lines)
    four = next(line for line in lines if line.startswith("read 4 of 13 bands, band / pixel interleave"))
    assert "0.17x" in four and "<= 0.5" in four and "over a 2k^2 uint16 raster (49 tiles" in four
    every = next(line for line in lines if line.startswith("read 13 of 13 bands, band / pixel interleave"))
    assert "1.10x" in every and " - " in every


def test_the_table_has_the_rank_and_merge_rss_of_segmentation_and_regression_by_side_and_their_growth():
    lines = format_table(bench_result(avx2_machine())).splitlines()
    seg = next(line for line in lines if line.startswith("segmentation merge RSS 32k^2 "))
    assert "315 MB" in seg and "<= 1024.0" in seg and "classes.tif + probabilities.tif COGs" in seg
    assert any(line.startswith("segmentation rank RSS 32k^2/4k^2") and "0.991x" in line for line in lines)
    rank = next(line for line in lines if line.startswith("regression rank RSS 32k^2 "))
    assert "1110 MB" in rank and "<= 1536.0" in rank and " yes " in rank and "median of runs 1140, 1150, 1160" in rank
    merge = next(line for line in lines if line.startswith("regression merge RSS 32k^2 "))
    assert "270 MB" in merge and "values.tif float32 COG of the whole raster, 70 s" in merge
    growth = next(line for line in lines if line.startswith("regression rank RSS 32k^2/4k^2"))
    assert "1.009x" in growth and "<= 1.05" in growth and " yes " in growth
    growth = next(line for line in lines if line.startswith("regression merge RSS 32k^2/4k^2"))
    assert "1.080x" in growth and "<= 1.05" in growth and " NO " in growth


def test_the_table_has_a_row_per_exported_form_with_its_efficiency_against_the_target():
    """make bench's row of the same U-Net in each form (bench/exported.py): tiles/s, which is fastest, and each
    form's pipeline efficiency against 0.90, met or not per form."""
    table = format_table(bench_result(avx2_machine()))
    rows = {line.split("  ")[0]: line for line in table.splitlines() if line.startswith("exported: ")}
    assert list(rows) == ["exported: eager", "exported: onnx", "exported: torch.export", "exported: torchscript"]
    assert re.search(r"0\.940\s+>= 0\.9\s+yes\s+11\.50 tiles/s \(fastest\), 32-true", rows["exported: onnx"])
    assert re.search(r"0\.880\s+>= 0\.9\s+NO\s+4\.10 tiles/s, 32-true", rows["exported: torch.export"])
    assert "pure forward 93.0 s / job 100.0 s; U-Net on resnet18 (segmentation)" in rows["exported: eager"]


def ceiling_details() -> dict:
    """bench/host_ceiling.py's result: segmentation at 0 and 1 workers, regression at 0."""

    def row(tiles_per_s: float) -> dict:
        stages = {"wait": 0.2, "h2d": 0.1, "forward": 0.3, "post": 0.1, "d2h": 0.0, "blend": 0.5, "write": 0.0}
        return {
            "tiles_per_s": tiles_per_s,
            "tiles_per_s_per_core": tiles_per_s / 2,
            "rank_wall_s": 784 / tiles_per_s,
            "job_wall_s": 5.0,
            "stages": stages,
            "read_s": 0.4,
            "workers": 0,
        }

    rows = {
        "segmentation/workers=0": row(480.0),
        "segmentation/workers=1": row(650.0),
        "regression/workers=0": row(500.0),
    }
    return {"rows": rows, "tiles": 784, "cores": 2, "side": 6144, "model": "null model (TorchScript 1x1 conv)"}


def test_the_table_has_the_host_ceiling_per_task_and_workers_judged_at_each_tasks_best():
    """make bench's null-model rows (bench/host_ceiling.py): tiles/s per rank and per core, the stage timeline; the
    600 tiles/s target is met by a task whose best worker count reaches it, and the whole job's row after them."""
    table = format_table(bench_result(avx2_machine()))
    rows = {line.split("  ")[0]: line for line in table.splitlines() if line.startswith("host ceiling: ")}
    assert list(rows) == [
        "host ceiling: segmentation/workers=0",
        "host ceiling: segmentation/workers=1",
        "host ceiling: regression/workers=0",
    ]
    assert re.search(
        r"480 tiles/s\s+>= 600\.0\s+yes\s+240 tiles/s per core", rows["host ceiling: segmentation/workers=0"]
    )
    assert re.search(r"500 tiles/s\s+>= 600\.0\s+NO\s+250 tiles/s per core", rows["host ceiling: regression/workers=0"])
    assert (
        "stages (s) wait 0.20, h2d 0.10, forward 0.30, post 0.10, d2h 0.00, blend 0.50"
        in rows["host ceiling: segmentation/workers=1"]
    )
    whole = next(line for line in table.splitlines() if line.startswith("whole job: segmentation"))
    assert "21.3 s" in whole and "rank 1.6 s (7% of the wall), 12.0 s after it" in whole
