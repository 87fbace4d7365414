"""The whole benchmark: inputs, every measurement in one run, targets, and the readable table."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from exported import measure_exported
from hardware import header, machine
from host_ceiling import measure_host_ceiling
from instances import measure_instances_merge, measure_instances_rank_rss
from many_bands import measure_bands
from measures import (
    PATCH,
    measure_agreement,
    measure_efficiency,
    measure_fastpath,
    measure_manifest,
    measure_merge,
    measure_precision,
    measure_rss,
    measure_scaling,
    read_tiles,
    spread,
    timed,
)
from points import measure_points_job, measure_points_merge
from rasterscale.grid.manifest import build_manifest, tiles_from_frame, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.raster.imagery import resolve_spec
from segmentation import measure_regression_rss, measure_segmentation_rss
from synthetic import write_detector, write_raster
from whole_job import measure_whole_job

REPO = Path(__file__).resolve().parents[1]
# Trained models and a scene they were not trained on, for the fp32 agreement, in order of preference: the
# DeepForest-format model fine-tuned by `make bench-deepforest`, then the demo's (`make demo`).
TRAINED_CANDIDATES = (
    (
        REPO / "results/bench-deepforest/results/models/deepforest_finetuned",
        REPO / "results/bench-deepforest/resources/demo/bench_heldout.tif",
    ),
    (REPO / "results/models/crowns.pt", REPO / "resources/demo/demo_heldout.tif"),
)


def find_trained_model() -> tuple[Path, Path]:
    """A trained model and its held-out raster; the agreement is measured on a trained model or not at all."""
    for model, raster in TRAINED_CANDIDATES:
        if model.exists() and raster.exists():
            return model, raster
    looked = "; ".join(f"{m.relative_to(REPO)} with {r.relative_to(REPO)}" for m, r in TRAINED_CANDIDATES)
    raise SystemExit(
        f"bench: the fp32 agreement needs a trained model and a scene it was not trained on ({looked}): run "
        "`make bench-deepforest` or `make demo` first, or pass --model and --raster"
    )


@dataclass(frozen=True)
class Sizes:
    job_side: int = 10240  # raster of the efficiency and scaling jobs (1024 tiles of 400 px)
    rss_sides: tuple[int, ...] = (4096, 16384, 32768)
    rss_tiles: int = 24  # tiles predicted on each RSS raster, spread over all of it
    fastpath_tiles: int = 12
    precision_batches: int = 1  # batches of fast-path tiles timed in fp32 and bf16 (bf16 may be emulated: ~70x)
    agreement_tiles: int = 64
    batch_size: int = 4
    merge_objects: int = 640_000  # about 1M boxes once tile overlaps are counted
    manifest_side: int = 100_000
    seg_rss_sides: tuple[int, ...] = (4096, 16384, 32768)  # segmentation: full-width tile rows, ~200 tiles each
    regression_rss_sides: tuple[int, ...] = (4096, 16384, 32768)  # regression: the same rows
    instances_crowns: int = 650_000  # about 1M instances once tile overlaps are counted
    instances_rss_sides: tuple[int, ...] = (4096, 16384, 32768)
    instances_rss_crowns: int = 15_000  # on every side: a 4k scene at 0.1 m of dense forest (about 900 a hectare)
    bands_tiles: int = 4  # tiles predicted at 3, 4 and 13 bands in each round (one batch)
    bands_rounds: int = 4  # rounds of every band count in turn (each part's fastest is the figure)
    interleave_side: int = 2048  # the 13-band raster read pixel- and band-interleaved (49 tiles)
    exported_side: int = 7168  # the scene each exported form predicts (1024 tiles of 256 px)
    ceiling_side: int = 6144  # the null model's scene (784 tiles of 256 px): the host ceiling
    points_merge: int = 1_000_000  # points of one scene, decoded by the tiles holding them (bench/points.py)
    points_job_side: int = 4096  # the scene a points job and a segmentation job predict (289 tiles of 256 px)


QUICK = Sizes(
    job_side=1600,
    rss_sides=(1024, 4096),
    rss_tiles=4,
    fastpath_tiles=4,
    agreement_tiles=8,
    merge_objects=20_000,
    seg_rss_sides=(1024, 4096),
    regression_rss_sides=(1024, 4096),
    instances_crowns=20_000,
    instances_rss_sides=(1024, 4096),
    instances_rss_crowns=1_000,
    bands_tiles=2,
    bands_rounds=1,
    interleave_side=1024,
    exported_side=1024,
    ceiling_side=1024,
    points_merge=20_000,
    points_job_side=1024,
)

TARGETS = {  # figure: (comparison, target)
    "efficiency": (">=", 0.90),
    "fastpath_speedup": (">=", 2.5),
    "scaling_2v1": (">=", 1.9),
    "rss_mb": ("<=", 1536.0),
    "merge_1m_s": ("<=", 10.0),
    "points_merge_1m_s": ("<=", 10.0),  # the points' core rule and one point per place (bench/points.py)
    # a points job's tiles/s over segmentation's at the same U-Net: its peaks decoded per batch on the device
    # cost no more than the blend they replace
    "points_job_vs_segmentation": (">=", 0.9),
    "manifest_100k_s": ("<=", 2.0),
    "seg_rank_rss_mb": ("<=", 1536.0),
    "seg_merge_rss_mb": ("<=", 1024.0),
    "seg_rank_rss_growth": ("<=", 1.05),  # the largest raster's peak over the smallest's
    "seg_merge_rss_growth": ("<=", 1.05),
    "regression_rank_rss_mb": ("<=", 1536.0),  # a U-Net regressor blending float values: segmentation's targets
    "regression_merge_rss_mb": ("<=", 1024.0),
    "regression_rank_rss_growth": ("<=", 1.05),
    "regression_merge_rss_growth": ("<=", 1.05),
    "instances_merge_1m_s": ("<=", 60.0),
    "instances_rank_rss_growth": ("<=", 1.05),  # an instances rank's peak on the largest raster over the smallest
    "instances_merge_rss_growth": ("<=", 1.10),  # the same crowns on the largest raster over the smallest
    # tiles/s of the same segmenter reading and predicting at 4 and 13 bands over 3 bands': only the read, the
    # input (normalization, padding, channels_last copy) and the first convolution grow with the bands (2 idle
    # cores: 13 raw uint16 bands add 0.035 s a tile to 0.115, 0.74x; busy cores slow the rest, the ratio nears 0.9)
    "bands4_throughput_vs_3": (">=", 0.90),
    "bands13_throughput_vs_3": (">=", 0.70),
    "bands13_rest_vs_3": ("<=", 1.10),  # the network past the first convolution: the same work at any band count
    # reading 4 of 13 bands band-interleaved over pixel-interleaved: the reader skips the other bands' blocks
    "interleave_4of13_band_vs_pixel": ("<=", 0.50),
    # the same U-Net as rasterscale's file, TorchScript, torch.export and ONNX (bench/exported.py): each form's
    # pure forward over its prediction job's wall
    "exported_efficiency": (">=", 0.90),
    # the null model's job (bench/host_ceiling.py): what the host path lets any accelerator reach, per task, at its
    # best worker count
    "host_ceiling_tiles_per_s": (">=", 600.0),
}


def met(figure: str, value: Any) -> bool:
    comparison, target = TARGETS[figure]
    values = list(value.values()) if isinstance(value, dict) else [value]
    return all(v <= target if comparison == "<=" else v >= target for v in values)


# the tasks whose ranks write blended rasters (bench/segmentation.py): the prefix of their figures, what the merge
# writes
DENSE = {
    "segmentation": ("seg", "classes.tif + probabilities.tif COGs of the whole raster and classes.gpkg"),
    "regression": ("regression", "values.tif float32 COG of the whole raster"),
}


def growth(by_side: dict[str, dict[str, Any]], key: str) -> float:
    """The largest raster's figure over the smallest's (1.0: flat)."""
    sides = sorted(by_side, key=int)
    return round(by_side[sides[-1]][key] / by_side[sides[0]][key], 3) if sides else float("nan")


def run_bench(workdir: Path, sizes: Sizes, trained: tuple[Path, Path]) -> dict[str, Any]:
    started = time.perf_counter()
    hardware = machine()
    auto = hardware["auto"]  # what predict.precision auto resolves to on this CPU: the fast path's precision
    model_file = write_detector(workdir / "resnet50.pt")
    raster = write_raster(workdir / "scene.tif", sizes.job_side)
    manifest = build_manifest(raster, PATCH, 80)
    write_manifest(manifest, resolve_spec(raster), TileGrid(PATCH, 80), workdir / "tiles.parquet")
    tiles = tiles_from_frame(manifest)
    details: dict[str, Any] = {}

    fastpath_images = read_tiles(raster, spread(tiles, sizes.fastpath_tiles))
    details["fastpath"] = timed(partial(measure_fastpath, model_file, fastpath_images, sizes.batch_size, auto))
    details["precision"] = timed(
        partial(measure_precision, model_file, fastpath_images, sizes.batch_size, auto, sizes.precision_batches)
    )
    agreement_model, agreement_raster = trained
    agreement_tiles = spread(tiles_from_frame(build_manifest(agreement_raster, PATCH, 80)), sizes.agreement_tiles)
    agreement_images = read_tiles(agreement_raster, agreement_tiles)
    details["agreement"] = timed(partial(measure_agreement, agreement_model, agreement_images, sizes.batch_size, auto))
    del fastpath_images, agreement_images
    job_manifest = workdir / "tiles.parquet"
    details["efficiency"] = timed(partial(measure_efficiency, workdir, raster, job_manifest, model_file, tiles, auto))
    details["scaling"] = timed(partial(measure_scaling, workdir, raster, job_manifest, model_file))
    details["rss"] = timed(partial(measure_rss, workdir, model_file, sizes.rss_sides, sizes.rss_tiles))
    details["merge"] = timed(partial(measure_merge, sizes.merge_objects))
    details["manifest"] = timed(partial(measure_manifest, workdir, sizes.manifest_side))
    details["points"] = timed(partial(measure_points_merge, workdir / "points", sizes.points_merge))
    details["points_job"] = timed(partial(measure_points_job, workdir / "points-job", sizes.points_job_side))
    details["segmentation"] = timed(partial(measure_segmentation_rss, workdir, sizes.seg_rss_sides))
    details["regression"] = timed(partial(measure_regression_rss, workdir, sizes.regression_rss_sides))
    details["instances_rank"] = timed(partial(measure_instances_rank_rss, workdir, sizes.rss_sides, sizes.rss_tiles))
    details["instances"] = timed(
        partial(
            measure_instances_merge,
            workdir,
            sizes.instances_crowns,
            sizes.instances_rss_sides,
            sizes.instances_rss_crowns,
        )
    )
    details["bands"] = timed(
        partial(measure_bands, workdir, sizes.bands_tiles, sizes.batch_size, sizes.interleave_side, sizes.bands_rounds)
    )

    details["exported"] = timed(partial(measure_exported, workdir / "exported", sizes.exported_side))
    details["host_ceiling"] = timed(partial(measure_host_ceiling, workdir / "ceiling", sizes.ceiling_side))
    details["whole_job"] = timed(partial(measure_whole_job, workdir / "whole-job", "segmentation", sizes.ceiling_side))

    figures = {
        "efficiency": details["efficiency"]["efficiency"],
        "fastpath_speedup": details["fastpath"]["speedup"],
        "scaling_2v1": details["scaling"]["scaling"],
        "rss_mb": {side: r["rss_peak_mb"] for side, r in details["rss"].items() if isinstance(r, dict)},
        "merge_1m_s": details["merge"]["seconds"],
        "manifest_100k_s": details["manifest"]["seconds"],
        "points_merge_1m_s": details["points"]["seconds"],
        "points_job_vs_segmentation": details["points_job"]["points_vs_segmentation"],
        **dense_figures(details, "segmentation"),
        **dense_figures(details, "regression"),
        "instances_merge_1m_s": details["instances"]["merge"]["seconds"],
        "instances_merge_rss_growth": growth(details["instances"]["rss"], "rss_peak_mb"),
        "instances_rank_rss_growth": growth(
            {side: r for side, r in details["instances_rank"].items() if isinstance(r, dict)}, "rss_peak_mb"
        ),
        **bands_figures(details["bands"]),
        # a form that failed counts as 0: the target is not met
        "exported_efficiency": {form: run.get("efficiency", 0.0) for form, run in details["exported"]["forms"].items()},
        "host_ceiling_tiles_per_s": ceiling_figures(details["host_ceiling"]),
    }
    return {
        **figures,
        "targets": {name: {"target": f"{c} {t}", "met": met(name, figures[name])} for name, (c, t) in TARGETS.items()},
        "agreement": details["agreement"],
        "details": details,
        "machine": hardware,
        "sizes": asdict(sizes),
        "bench_wall_s": round(time.perf_counter() - started, 1),
    }


def format_table(result: dict[str, Any]) -> str:
    """The figures, their targets and how each was measured, as one readable table."""
    d = result["details"]
    eff, fast, scale = d["efficiency"], d["fastpath"], d["scaling"]
    agree = result["agreement"]
    rows: list[tuple[str, str, str | None, str]] = [
        (
            "pipeline efficiency",
            f"{result['efficiency']:.3f}",
            "efficiency",
            f"forward {eff['forward_s']:.1f} s over {eff['tiles']} preloaded tiles / job wall {eff['job_wall_s']:.1f} s"
            f" (in-loop {eff['in_loop_efficiency']:.3f}: batches {eff['in_loop']['compute_over_forward_s']:+.1f} s"
            f" over the forward, output {eff['in_loop']['output_s']:.1f} s, data wait {eff['in_loop']['wait_s']:.1f} s;"
            f" without a reading worker"
            f" {eff['in_loop']['workers0_in_loop_efficiency']:.3f}; startup+write {eff['startup_and_write_s']:.1f} s)",
        ),
        (
            f"auto ({fast['precision']}) fast path vs fp32 batch 1",
            f"{result['fastpath_speedup']:.2f}x",
            "fastpath_speedup",
            f"fp32 b1 {fast['baseline_s_per_tile']:.3f} s/tile -> fast path b{result['sizes']['batch_size']}"
            f" {fast['fast_s_per_tile']:.3f} s/tile (RetinaNet-ResNet50, {PATCH} px, {fast['threads']} threads)",
        ),
        precision_row(d["precision"], result["machine"]),
        (
            "scaling 2 ranks vs 1",
            f"{result['scaling_2v1']:.2f}x",
            "scaling_2v1",
            f"job wall {scale['one_rank']['job_wall_s']:.1f} s -> {scale['two_ranks']['job_wall_s']:.1f} s,"
            f" 1 thread per rank; throughput x{scale['throughput_scaling']:.2f}",
        ),
    ]
    for side, mb in result["rss_mb"].items():
        rss = d["rss"][side]
        rows.append(
            (
                f"peak RSS {int(side) // 1024}k^2 window",
                f"{mb:.0f} MB",
                "rss_mb",
                f"{rss['predicted_tiles']} of {rss['manifest_tiles']} tiles spread over the raster, workers 0",
            )
        )
    rows += [
        (
            "merge 1M boxes",
            f"{result['merge_1m_s']:.2f} s",
            "merge_1m_s",
            f"{d['merge']['boxes']} boxes from {d['merge']['tiles']} overlapping tiles -> {d['merge']['kept']} kept",
        ),
        (
            "manifest 100k^2",
            f"{result['manifest_100k_s']:.2f} s",
            "manifest_100k_s",
            f"{d['manifest']['tiles']} tiles, build_manifest + GeoParquet",
        ),
        (
            "points: 1M, core rule + merge",
            f"{result['points_merge_1m_s']:.2f} s",
            "points_merge_1m_s",
            f"{d['points']['decoded']} decoded by {d['points']['tiles']} tiles -> {d['points']['kept']} kept "
            f"(ranks {d['points']['ranks_s']:.1f} s, merge {d['points']['merge_s']:.1f} s; the merge job with "
            f"its files {d['points']['merge_job_s']:.1f} s)",
        ),
        (
            "points job / segmentation job",
            f"{result['points_job_vs_segmentation']:.2f}x",
            "points_job_vs_segmentation",
            f"tiles/s {d['points_job']['points']['tiles_per_s']:.2f} vs "
            f"{d['points_job']['segmentation']['tiles_per_s']:.2f} ({d['points_job']['model']}, 1 CPU rank), "
            f"{d['points_job']['points']['points_per_s']:.0f} points/s",
        ),
    ]
    rows += dense_rows(result, "segmentation") + dense_rows(result, "regression")
    rows += instances_rows(result)
    rows += bands_rows(result)
    rows += exported_rows(result)
    rows += ceiling_rows(result)
    rows += whole_job_rows(result)
    table = [("figure", "measured", "target", "met", "how")] + [target_cells(result, row) for row in rows]
    widths = [max(len(r[k]) for r in table) for k in range(4)]
    lines = [
        *header(result["machine"], result["bench_wall_s"]),
        *("  ".join(cell.ljust(widths[k]) if k < 4 else cell for k, cell in enumerate(row)) for row in table),
        f"fp32 agreement ({agree['model_file']}, {agree['tiles']} tiles, score >= {agree['score_threshold']}):"
        f" {agree['fp32_matched_fraction']:.1%} of {agree['fp32']} fp32 boxes and {agree['fast_matched_fraction']:.1%}"
        f" of {agree['fast']} auto ({agree['precision']}) fast-path boxes matched at IoU >= {agree['min_iou']};"
        f" |score diff| mean {agree['score_abs_diff_mean']} max {agree['score_abs_diff_max']};"
        f" {agree['unmatched_near_threshold']} unmatched boxes within 0.02 of the threshold",
        "load average (1 min) before/after each section: "
        + ", ".join(f"{k} {v['load_1min']}" for k, v in d.items() if "load_1min" in v),
    ]
    return "\n".join(lines)


def dense_figures(details: dict[str, Any], task: str) -> dict[str, Any]:
    """The targeted figures of a task of :data:`DENSE`: its rank's and merge's peak RSS by side, and their growth."""
    prefix = DENSE[task][0]
    by_side = {side: r for side, r in details[task].items() if isinstance(r, dict)}
    return {
        f"{prefix}_rank_rss_mb": {side: r["rank_rss_peak_mb"] for side, r in by_side.items()},
        f"{prefix}_merge_rss_mb": {side: r["merge_rss_peak_mb"] for side, r in by_side.items()},
        f"{prefix}_rank_rss_growth": growth(by_side, "rank_rss_peak_mb"),
        f"{prefix}_merge_rss_growth": growth(by_side, "merge_rss_peak_mb"),
    }


def dense_rows(result: dict[str, Any], task: str) -> list[tuple[str, str, str | None, str]]:
    """The rows of a task of :data:`DENSE`: its rank's and merge's peak RSS on each raster, and their growth from the
    smallest raster to the largest."""
    prefix, writes = DENSE[task]
    by_side = {side: r for side, r in result["details"][task].items() if isinstance(r, dict)}
    rows: list[tuple[str, str, str | None, str]] = []
    for side, r in by_side.items():
        k = f"{int(side) // 1024}k^2"
        rows.append(
            (
                f"{task} rank RSS {k}",
                f"{r['rank_rss_peak_mb']:.0f} MB",
                f"{prefix}_rank_rss_mb",
                f"{r['predicted_tiles']} tiles: {r['tile_rows']} full-width tile rows; median of runs "
                f"{', '.join(f'{v:.0f}' for v in r['rank_rss_peaks_mb'])} MB; job {r['job_wall_s']:.0f} s",
            )
        )
        rows.append(
            (
                f"{task} merge RSS {k}",
                f"{r['merge_rss_peak_mb']:.0f} MB",
                f"{prefix}_merge_rss_mb",
                f"{writes}, {r['merge_wall_s']:.0f} s",
            )
        )
    sides = sorted(by_side, key=int)
    if sides:
        first, last = (f"{int(sides[k]) // 1024}k^2" for k in (0, -1))
        for what in ("rank", "merge"):
            key = f"{prefix}_{what}_rss_growth"
            rows.append(
                (
                    f"{task} {what} RSS {last}/{first}",
                    f"{result[key]:.3f}x",
                    key,
                    f"peak RSS on the {last} raster over the {first} one's, measured in this run (1.0: flat)",
                )
            )
    return rows


def instances_rows(result: dict[str, Any]) -> list[tuple[str, str, str | None, str]]:
    """The rows of the instances' merge: a million crowns stitched, and its peak RSS as the raster grows."""
    merge, rss = result["details"]["instances"]["merge"], result["details"]["instances"]["rss"]
    sides = sorted(rss, key=int)
    first, last = (f"{int(sides[k]) // 1024}k^2" for k in (0, -1))
    return [
        (
            "merge 1M crowns",
            f"{result['instances_merge_1m_s']:.1f} s",
            "instances_merge_1m_s",
            f"merge_scene: {merge['instances']} instances ({merge['cut']} cut, {merge['vertices_mean']} vertices"
            f" each) of {merge['drawn']} crowns drawn, from {merge['tiles']} overlapping tiles in 4 rank files ->"
            f" {merge['crowns']} crowns, GeoParquet + GeoPackage, one core; peak RSS {merge['rss_peak_mb']:.0f} MB;"
            f" {merge['all_cores']['seconds']:.1f} s on {merge['all_cores']['cores']} cores",
        ),
        (
            f"instances merge RSS {last}/{first}",
            f"{result['instances_merge_rss_growth']:.3f}x",
            "instances_merge_rss_growth",
            f"{rss[sides[0]]['drawn']} crowns drawn on each raster: "
            + ", ".join(f"{int(side) // 1024}k^2 {rss[side]['rss_peak_mb']:.0f} MB" for side in sides)
            + " (memory follows the crowns, not the pixels)",
        ),
        instances_rank_row(result),
    ]


def bands_figures(bands: dict[str, Any]) -> dict[str, float]:
    """The targeted figures of many bands (bench/many_bands.py): throughput against 3 bands, interleave's reads."""
    throughput = bands["throughput"]["bands"]
    return {
        "bands4_throughput_vs_3": throughput["4"]["throughput_vs_3"],
        "bands13_throughput_vs_3": throughput["13"]["throughput_vs_3"],
        "bands13_rest_vs_3": throughput["13"]["rest_vs_3"],
        "interleave_4of13_band_vs_pixel": bands["interleave"]["four"]["band_over_pixel"],
    }


def bands_rows(result: dict[str, Any]) -> list[tuple[str, str, str | None, str]]:
    """The rows of many bands: tiles/s at 4 and 13 bands against 3, where the time goes; reads by interleave."""
    throughput, interleave = result["details"]["bands"]["throughput"], result["details"]["bands"]["interleave"]
    base = throughput["bands"]["3"]
    rows: list[tuple[str, str, str | None, str]] = []
    for count in ("4", "13"):
        run = throughput["bands"][count]
        key = f"bands{count}_throughput_vs_3"
        parts = ", ".join(
            f"{name} {base[f'{part}_s_per_tile']:.3f} -> {run[f'{part}_s_per_tile']:.3f}"
            for name, part in (("read", "read"), ("input", "input"), ("first conv", "first_conv"), ("rest", "rest"))
        )
        rows.append(
            (
                f"throughput {count} / 3 bands",
                f"{result[key]:.2f}x",
                key,
                f"{base['tiles_per_s']:.2f} -> {run['tiles_per_s']:.2f} tiles/s ({run['dtype']}), read in line;"
                f" s/tile {parts}; {throughput['model']}, {throughput['tiles']} tiles b{throughput['batch_size']},"
                f" {throughput['threads']} threads, each part's fastest of {throughput['rounds']} rounds",
            )
        )
    run = throughput["bands"]["13"]
    extra = {part: run[f"{part}_s_per_tile"] - base[f"{part}_s_per_tile"] for part in ("read", "input", "first_conv")}
    rows.append(
        (
            "rest of the network 13 / 3 bands",
            f"{result['bands13_rest_vs_3']:.3f}x",
            "bands13_rest_vs_3",
            f"s/tile past the first convolution {base['rest_s_per_tile']:.3f} -> {run['rest_s_per_tile']:.3f}, GFLOP"
            f" {base['gflop_per_tile'] - base['first_conv_gflop_per_tile']:.2f} ->"
            f" {run['gflop_per_tile'] - run['first_conv_gflop_per_tile']:.2f}; what 13 bands add a tile: read"
            f" {extra['read']:+.3f} s, input {extra['input']:+.3f} s, first conv {extra['first_conv']:+.3f} s"
            f" ({base['first_conv_gflop_per_tile']:.2f} -> {run['first_conv_gflop_per_tile']:.2f} GFLOP)",
        )
    )
    k = f"{interleave['side'] // 1024}k^2" if interleave["side"] % 1024 == 0 else f"{interleave['side']}^2"
    for what, key in (("four", "interleave_4of13_band_vs_pixel"), ("all", None)):
        read = interleave[what]
        bands = "all bands" if read["bands"] == list(range(1, 14)) else f"bands {read['bands']}"
        rows.append(
            (
                f"read {len(read['bands'])} of 13 bands, band / pixel interleave",
                f"{read['band_over_pixel']:.2f}x",
                key,
                f"read_tile over a {k} uint16 raster ({interleave['tiles']} tiles of {PATCH} px, {bands} raw):"
                f" pixel {read['pixel_s']:.3f} s ({read['pixel_mb_per_s']:.0f} MB/s), band {read['band_s']:.3f} s"
                f" ({read['band_mb_per_s']:.0f} MB/s) a raster; {interleave['block']} px blocks, deflate, files"
                f" {interleave['pixel_file_mb']:.0f} and {interleave['band_file_mb']:.0f} MB; block cache"
                f" {interleave['read_cache_mb']} MB (the rank's); fastest of {interleave['rounds']} passes",
            )
        )
    return rows


def instances_rank_row(result: dict[str, Any]) -> tuple[str, str, str | None, str]:
    """The row of an instances rank's peak RSS as the raster grows."""
    ranks = {side: r for side, r in result["details"]["instances_rank"].items() if isinstance(r, dict)}
    sides = sorted(ranks, key=int)
    first, last = (f"{int(sides[k]) // 1024}k^2" for k in (0, -1))
    return (
        f"instances rank RSS {last}/{first}",
        f"{result['instances_rank_rss_growth']:.3f}x",
        "instances_rank_rss_growth",
        f"one CPU rank, an untrained Mask R-CNN at score 0 ({ranks[sides[0]]['instances']} crowns from"
        f" {ranks[sides[0]]['tiles']} tiles on each raster): "
        + ", ".join(f"{int(side) // 1024}k^2 {ranks[side]['rss_peak_mb']:.0f} MB" for side in sides),
    )


def precision_row(p: dict[str, Any], hardware: dict[str, Any]) -> tuple[str, str, str | None, str]:
    """The table's row of the fast path's fp32 and bf16 seconds per tile, and what ``auto`` picks: no target."""
    return (
        "bf16 / fp32 fast path time",
        f"{p['bf16_over_fp32']:.2f}x",
        None,
        f"fp32 {p['fp32_s_per_tile']:.3f} s/tile ({p['fp32_tiles']} tiles), bf16 autocast {p['bf16_s_per_tile']:.3f}"
        f" s/tile ({p['bf16_tiles']} tiles), b{p['batch_size']}; {p['gflop_per_tile']} GFLOP a tile:"
        f" fp32 {p['fp32_gflops_per_thread']}, bf16 {p['bf16_gflops_per_thread']} GFLOPS a thread;"
        f" auto picks {p['auto']} (bf16 {'native' if hardware['bf16_native'] else 'emulated'}: {hardware['onednn']})",
    )


def target_cells(result: dict[str, Any], row: tuple[str, str, str | None, str]) -> tuple[str, str, str, str, str]:
    """A row's cells: figure, measured, its target and whether it is met ("-" for a figure without target), how."""
    name, value, key, how = row
    if key is None:
        return name, value, "-", "-", how
    return name, value, result["targets"][key]["target"], "yes" if met(key, _value(result, key, name)) else "NO", how


def _value(result: dict[str, Any], key: str, name: str) -> Any:
    if key == "exported_efficiency":  # by form: this row's ("exported: <form>")
        return result[key][name.split(": ", 1)[1]]
    if key == "host_ceiling_tiles_per_s":  # by task, its best worker count ("host ceiling: <task>/workers=<n>")
        return result[key][name.split(": ", 1)[1].split("/")[0]]
    if isinstance(result[key], dict):  # a figure by side (rss_mb, the dense tasks' RSS): this row's side
        side = next(s for s in result[key] if f" {int(s) // 1024}k^2" in name)
        return result[key][side]
    return result[key]


def ceiling_figures(ceiling: dict[str, Any]) -> dict[str, float]:
    """Each task's host ceiling: its null-model job's tiles/s at its best worker count."""
    best: dict[str, float] = {}
    for name, row in ceiling["rows"].items():
        task = name.split("/")[0]
        best[task] = max(best.get(task, 0.0), row["tiles_per_s"])
    return best


def ceiling_rows(result: dict[str, Any]) -> list[tuple[str, str, str | None, str]]:
    """One row per task and worker count of the null-model job: tiles/s per rank and per core, the stages."""
    ceiling = result["details"]["host_ceiling"]
    rows: list[tuple[str, str, str | None, str]] = []
    for name, row in ceiling["rows"].items():
        stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in row["stages"].items())
        rows.append(
            (
                f"host ceiling: {name}",
                f"{row['tiles_per_s']:.0f} tiles/s",
                "host_ceiling_tiles_per_s",
                f"{row['tiles_per_s_per_core']:.0f} tiles/s per core; rank {row['rank_wall_s']:.2f} s of job"
                f" {row['job_wall_s']:.2f} s; stages (s) {stages}; read in workers {row['read_s']:.2f} s;"
                f" {ceiling['model']}, {ceiling['tiles']} tiles",
            )
        )
    return rows


def whole_job_rows(result: dict[str, Any]) -> list[tuple[str, str, str | None, str]]:
    """The null model's whole workflow run (bench/whole_job.py): its wall, the rank's share, each rule's wall."""
    job = result["details"]["whole_job"]
    rules = ", ".join(f"{rule} {seconds:.1f}" for rule, seconds in job["rules_s"].items())
    return [
        (
            f"whole job: {job['task']}",
            f"{job['wall_s']:.1f} s",
            None,
            f"rank {job['rank_wall_s']:.1f} s ({1 - job['outside_rank']:.0%} of the wall), {job['after_rank_s']:.1f} s"
            f" after it; rules (s) {rules}; snakemake --cores {job['cores']}, {job['tiles']} tiles, {job['model']}",
        )
    ]


def exported_rows(result: dict[str, Any]) -> list[tuple[str, str, str | None, str]]:
    """One row per form of the same U-Net: its job's tiles/s, and its efficiency against the target."""
    exported = result["details"]["exported"]
    rows: list[tuple[str, str, str | None, str]] = []
    for form, run in exported["forms"].items():
        if "error" in run:
            rows.append((f"exported: {form}", "failed", "exported_efficiency", run["error"]))
            continue
        fastest = " (fastest)" if form == exported["fastest"] else ""
        rows.append(
            (
                f"exported: {form}",
                f"{run['efficiency']:.3f}",
                "exported_efficiency",
                f"{run['tiles_per_s']:.2f} tiles/s{fastest}, {run['precision']}; pure forward {run['forward_s']:.1f} s"
                f" / job {run['job_wall_s']:.1f} s; {exported['model']}, {run['tiles']} tiles",
            )
        )
    return rows
