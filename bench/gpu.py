"""make bench-gpu: GPU acceptance in one command (not part of the tests). Writes results/bench-gpu.json and
results/bench-gpu.txt, prints the table, and on GPUs records their entry of results/throughput.json (the prediction
and training jobs' rates per GPU, for the dry run's cost estimate).

On every visible GPU (one rank each): a short training and a prediction with the real jobs at ``auto`` and at
``32-true``, the prediction job's tiles/s against the model's pure forward at DeepForest's scale, torch.compile
of the backbone, FPN and head (kept or not), NVML utilization and peak memory per rank, and pinned against
pageable copies of uint8 batches beside the job's data wait (gpu_measures.py says how). Without CUDA, or with
--cpu, the same code on tiny sizes on CPU ranks, in a minute or two: tests/test_bench_gpu.py runs that.
The JSON is rewritten after every section, so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_measures import SECTIONS, attempt, chosen_sections, make_bench, nvml_devices, ok, run_sections  # noqa: E402
from rasterscale.jobs.paths import throughput_file  # noqa: E402
from rasterscale.workflow.throughput import write_throughput  # noqa: E402
from suite import machine  # noqa: E402
from throughput import gpu_entry  # noqa: E402

Row = tuple[str, str, str, str]  # section, figure, value, how


def describe_machine() -> dict[str, Any]:
    gpus = (
        [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {**attempt(machine), "gpus": gpus, "cuda": torch.version.cuda, "nvml": nvml_devices()}


def run_gpu_bench(
    workdir: Path, cpu: bool, save: Callable[[dict[str, Any]], None], sections: Sequence[str] | None = None
) -> dict[str, Any]:
    """The whole run (or its ``sections``); ``save(result)`` after every section."""
    started = time.perf_counter()
    bench = make_bench(workdir, cpu)
    result: dict[str, Any] = {
        "mode": bench.accelerator,
        "ranks": bench.ranks,
        "auto": bench.auto,
        "machine": describe_machine(),
        "sizes": asdict(bench.sizes),
        "sections": {},
    }

    def done(name: str, section: dict[str, Any]) -> None:
        result["sections"][name] = section
        result["bench_wall_s"] = round(time.perf_counter() - started, 1)
        save(result)
        state = f"error: {section['error']}" if "error" in section else "done"
        print(f"bench-gpu: {name} {state} ({section['section_s']:.0f} s)", file=sys.stderr, flush=True)

    run_sections(bench, done, sections)
    return result


# --- the table ------------------------------------------------------------------------------------------------


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def label(requested: str, run: dict[str, Any]) -> str:
    used = run.get("precision")
    if run.get("one_run"):  # auto is 32-true on this device: one job stands for both (gpu_measures.at_each_precision)
        return f"{requested} (auto's run)"
    return f"auto ({used})" if requested == "auto" and used else requested


def validation_text(run: dict[str, Any]) -> str:
    scores = run.get("validation") or {}
    found = " ".join(f"{key} {value:.3f}" for key, value in scores.items() if key != "epoch")
    return f"validated after the last step ({found})" if found else "no validation scores"


def train_rows(section: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for requested, run in section["runs"].items():
        if not ok(run):
            rows.append(("train", requested, "error", run["error"]))
            continue
        per_rank = run["batch"] // run["ranks"]
        rows.append(
            (
                "train",
                label(requested, run),
                f"{run['steps_per_s']:.2f} steps/s",
                f"{run['images_per_s']:.1f} images/s, step {run['step_ms']:.0f} ms (first to last progress line);"
                f" {run['ranks']} rank(s)"
                f" x {per_rank} tiles, {run['steps']} steps, {run['workers']} workers; fit {run['fit_s']} s,"
                f" job {run['job_wall_s']:.0f} s; {validation_text(run)}; {section['model']}",
            )
        )
    if section.get("auto_speedup"):
        how = "32-true's step time / auto's" + same_precision(section["runs"])
        rows.append(("train", "auto vs 32-true", f"{section['auto_speedup']:.2f}x", how))
    return rows


def same_precision(runs: dict[str, Any]) -> str:
    """A note where ``auto`` resolved to the same precision as 32-true on each rank but was run twice: the two runs
    are the same, their difference is noise."""
    used = {run.get("precision") for run in runs.values()}
    return f" ({used.pop()} both: auto is 32-true on this device, the difference is noise)" if len(used) == 1 else ""


def rank_row(requested: str, run: dict[str, Any], rank: dict[str, Any]) -> Row:
    return (
        "predict",
        f"rank {rank['rank']} ({requested})",
        f"{rank['tiles_per_s']:.1f} tiles/s",
        f"{rank['device']}, precision {rank['precision']}, {rank['tiles']} tiles; util {percent(rank['utilization'])}"
        f" ({rank['utilization_source']}), peak {rank['memory_peak_mb']:.0f} MB ({rank['memory_kind']}),"
        f" data wait {percent(rank['wait_fraction'])}, output {percent(rank['output_fraction'])}",
    )


def predict_rows(section: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    ranks: list[Row] = []
    for requested, run in section["runs"].items():
        if not ok(run):
            rows.append(("predict", requested, "error", run["error"]))
            continue
        first = run["ranks"][0] if run["ranks"] else {}
        rows.append(
            (
                "predict",
                label(requested, run),
                f"{run['tiles_per_s']:.1f} tiles/s",
                f"{run['tiles']} tiles, {len(run['ranks'])} rank(s), batch {first.get('batch_size')},"
                f" {first.get('workers')} workers; job {run['job_wall_s']:.0f} s; data wait"
                f" {percent(run['wait_fraction'])}; {section['model']}",
            )
        )
        ranks += [rank_row(requested, run, rank) for rank in run["ranks"]]
    if section.get("auto_speedup"):
        how = "tiles/s, auto's / 32-true's" + same_precision(section["runs"])
        rows.append(("predict", "auto vs 32-true", f"{section['auto_speedup']:.2f}x", how))
    return rows + scaling_rows(section.get("scaling")) + ranks


def scaling_rows(scaling: dict[str, Any] | None) -> list[Row]:
    """The auto job on every rank against one rank alone (or why it was not measured; nothing from a run that
    stopped before it)."""
    if scaling is None:
        return []
    if not ok(scaling):
        return [("predict", "ranks vs one", "error", scaling["error"])]
    if "speedup" not in scaling:
        return [("predict", "ranks vs one", "-", scaling["note"])]
    how = (
        f"the auto job's tiles/s on {scaling['ranks']} ranks ({scaling['all_ranks_tiles_per_s']:.1f}) over one rank"
        f" alone ({scaling['one_rank_tiles_per_s']:.1f}); per rank {scaling['efficiency']:.2f}"
    )
    return [("predict", f"{scaling['ranks']} ranks vs one", f"{scaling['speedup']:.2f}x", how)]


def forward_rows(section: dict[str, Any]) -> list[Row]:
    where = f"{section['tiles']} tiles on {section['device']}" + (
        f" ({section['threads']} thread(s), as a rank)" if section["threads"] else ""
    )
    rows: list[Row] = [
        (
            "forward",
            f"pure forward, batch {batch}",
            f"{rate:.1f} tiles/s",
            f"{section['precision']}, uint8 {where}, scaled there, the job's batched model with anchors and NMS;"
            f" median of {section['rounds']} rounds; {section['model']}",
        )
        for batch, rate in section["tiles_per_s"].items()
    ]
    for batch, rate in section["fp32_tiles_per_s"].items():
        rows.append(("forward", f"pure forward, batch {batch}, 32-true", f"{rate:.1f} tiles/s", f"fp32, {where}"))
    if section.get("auto_over_fp32") is not None:
        rows.append(("forward", f"{section['precision']} / 32-true", f"{section['auto_over_fp32']:.2f}x", "tiles/s"))
    agreement = section["precision_agreement"]
    value, how = agreement_text(agreement, "32-true", agreement["precision"])
    rows.append(
        (
            "forward",
            f"{agreement['precision']} vs 32-true boxes",
            value,
            f"{how} (eager both, score >= {agreement['score_threshold']}): the precision's own effect",
        )
    )
    if section["device"].startswith("cuda"):
        rows.append(
            (
                "forward",
                "NVML util, peak memory",
                percent(section["utilization"]),
                f"during the pure forward; peak {section['memory_peak_mb']:.0f} MB allocated",
            )
        )
    if section.get("job_over_forward") is not None:
        per_rank = ", ".join(f"{rate:.1f}" for rate in section["job_rank_tiles_per_s"])
        rows.append(
            (
                "forward",
                "job / pure forward",
                f"{section['job_over_forward']:.3f}",
                f"the auto job's tiles/s per rank ({per_rank}) over the pure forward at its batch"
                f" {section['job_batch']}",
            )
        )
    else:
        rows.append(("forward", "job / pure forward", "-", section.get("job_note", "")))
    return rows


def agreement_text(agreement: dict[str, Any], reference: str, other: str) -> tuple[str, str]:
    """A box agreement's value (matched fractions, each way) and how it was counted."""
    value = f"{percent(agreement['reference_matched_fraction'])} / {percent(agreement['other_matched_fraction'])}"
    how = (
        f"of {agreement['reference']} {reference} / {agreement['other']} {other} boxes matched at IoU >="
        f" {agreement['min_iou']}; |score diff| mean {agreement['score_abs_diff_mean']}"
    )
    return value, how


def compile_rows(section: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for name, run in section["runs"].items():
        if not ok(run):
            rows.append(("compile", name, "error", run["error"]))
            continue
        rates = run["tiles_per_s"]
        value, how = agreement_text(run["agreement"], "eager", "compiled")
        rows += [
            (
                "compile",
                f"{name}: compiled vs eager",
                f"{run['speedup']:.2f}x",
                f"backbone+FPN+head compiled ({run['backend']}, mode {run['mode']}), anchors and NMS eager;"
                f" {run['tiles']} tiles at batch {run['batch']}: {rates['eager']:.1f} -> {rates['compiled']:.1f}"
                f" tiles/s; compile {run['compile_s']:.0f} s",
            ),
            ("compile", f"{name}: same boxes", value, f"{how} (score >= {run['score_threshold']})"),
            ("compile", f"{name}: verdict", "kept" if run["kept"] else "not kept", run["rule"] + eager_note(run)),
        ]
    kept = ", ".join(section["kept_modes"]) or "none"
    rows.append(("compile", "modes kept", kept, f"kept at every precision measured; {section['model']}"))
    return rows


def eager_note(section: dict[str, Any]) -> str:
    if section["backend"] != "eager":
        return ""
    return " (the eager backend checks that the graphs are captured: its speed is noise, not the compiler's)"


def instances_rows(section: dict[str, Any]) -> list[Row]:
    """Mask R-CNN's job against its pure forward."""
    per_rank = ", ".join(f"{rank['tiles_per_s']:.1f}" for rank in section["ranks"])
    ratio = section["job_over_forward"]
    return [
        (
            "instances",
            "job",
            f"{section['tiles_per_s']:.1f} tiles/s",
            f"{section['tiles']} tiles, {len(section['ranks'])} rank(s) ({per_rank} tiles/s), batch"
            f" {section['batch']}, {section['precision']}; data wait {percent(section['wait_fraction'])};"
            f" {section['model']}",
        ),
        (
            "instances",
            f"pure forward, batch {section['batch']}",
            f"{section['forward_tiles_per_s']:.1f} tiles/s",
            "the batched Mask R-CNN as the job runs it, masks pasted and thresholded; tiles preloaded on the device",
        ),
        ("instances", "job / pure forward", "-" if ratio is None else f"{ratio:.3f}", "tiles/s per rank over it"),
    ]


def copy_rows(section: dict[str, Any]) -> list[Row]:
    shape = "x".join(str(n) for n in section["batch_shape"])
    rows: list[Row] = []
    for kind, how in (("pinned", "pinned, non-blocking"), ("pageable", "pageable")):
        rate, ms = section["gb_per_s"][kind], section["ms_per_batch"][kind]
        detail = f"uint8 batch {shape} ({section['batch_mb']} MB) -> {section['device']}"
        if rate is None:
            rows.append(("copy", how, "-", f"{detail}: {section['pinned_note']}"))
        else:
            rows.append(("copy", how, f"{rate:.2f} GB/s", f"{detail}: {ms:.3f} ms a batch"))
    waits = section["job_rank_wait_fraction"]
    rows.append(
        (
            "copy",
            "job data wait",
            percent(section["job_wait_fraction"]),
            "auto prediction job"
            + (f", ranks {', '.join(percent(w) for w in waits)}" if waits else ": none (it failed)")
            + f"; tiles pinned and copied non-blocking: {'yes' if section['job_pins'] else 'no (CPU)'}",
        )
    )
    return rows


def dense_rows(section: dict[str, Any]) -> list[Row]:
    """The null model's jobs (the host ceiling) and the U-Net's job against its pure forward, with their stages."""
    ceiling = section["ceiling"]
    rows: list[Row] = []
    for name, row in ceiling["rows"].items():
        stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in row["stages"].items())
        rows.append(
            (
                "dense",
                f"host ceiling, {name}",
                f"{row['tiles_per_s']:.0f} tiles/s",
                f"{row['workers']} worker(s); rank {row['rank_wall_s']:.2f} s of job {row['job_wall_s']:.2f} s;"
                f" stages (s) {stages}; read in workers {row['read_s']:.2f} s; {ceiling['model']},"
                f" {ceiling['tiles']} tiles",
            )
        )
    unet = section["unet"]
    if "error" in unet:
        return [*rows, ("dense", "U-Net job / pure forward", "error", unet["error"])]
    stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in unet["stages"].items())
    rows.append(
        (
            "dense",
            f"U-Net job / pure forward, batch {unet['batch']}",
            f"{unet['job_over_forward']:.3f}",
            f"job {unet['tiles_per_s']:.0f} tiles/s ({unet['workers']} worker(s), {unet['precision']}), pure forward"
            f" {unet['forward_tiles_per_s']:.0f} tiles/s; whole job {unet['job_wall_s']:.1f} s; stages (s) {stages};"
            f" read in workers {unet['read_s']:.2f} s; {unet['tiles']} tiles of 256 px",
        )
    )
    return rows


FORMATTERS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "dense": dense_rows,
    "train": train_rows,
    "predict": predict_rows,
    "forward": forward_rows,
    "compile": compile_rows,
    "instances": instances_rows,
    "copy": copy_rows,
}


def section_rows(name: str, section: dict[str, Any] | None) -> list[Row]:
    """A section's rows; its error instead where it failed, or was not run (a run cut short)."""
    if section is None:
        return [(name, "not run", "-", "the run ended before this section")]
    if "error" in section:
        return [(name, "error", "-", section["error"])]
    try:
        return FORMATTERS[name](section)
    except Exception as err:  # a table that lacks a row still shows the others
        return [(name, "unreadable", "-", f"{type(err).__name__}: {err}")]


def header(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    devices = ", ".join(m["gpus"]) if result["mode"] == "gpu" else f"CPU ({m.get('cpu', '?')})"
    nvml = m["nvml"]
    nvml_line = (
        f"NVML: {nvml['error']}"
        if "error" in nvml
        else f"NVML: driver {nvml['driver']}; "
        + "; ".join(f"{d['index']}: {d['name']} {d['memory_total_mb']} MB" for d in nvml["devices"])
    )
    return [
        f"rasterscale bench-gpu ({result['mode']}): {devices}; {result['ranks']} rank(s); torch {m.get('torch')}"
        f" (CUDA {m['cuda']}); precision auto -> {result['auto']}; {result.get('bench_wall_s', 0):.0f} s",
        nvml_line,
    ]


def format_table(result: dict[str, Any]) -> str:
    rows: list[Row] = [("section", "figure", "value", "how")]
    for name, _ in SECTIONS:
        rows += section_rows(name, result["sections"].get(name))
    widths = [max(len(row[k]) for row in rows) for k in range(3)]
    lines = ["  ".join([*(row[k].ljust(widths[k]) for k in range(3)), row[3]]).rstrip() for row in rows]
    return "\n".join(header(result) + lines)


def write_result(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".txt").write_text(format_table(result) + "\n")


def section_list(text: str) -> list[str]:
    try:
        return chosen_sections(text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "results/bench-gpu.json"))
    parser.add_argument("--cpu", action="store_true", help="the short CPU run, also where CUDA is available")
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    parser.add_argument(
        "--throughput",
        default=str(REPO / throughput_file()),
        help="the file the GPU's throughput entry goes to (a GPU run's only; '' for none)",
    )
    parser.add_argument(
        "--sections",
        type=section_list,
        help=f"only these, comma-separated (of {','.join(name for name, _ in SECTIONS)}): a rerun after a change,"
        " to spare a lent GPU's minutes (without train, the others predict with an untrained model)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="rasterscale-bench-gpu-", dir=args.workdir) as workdir:
        result = run_gpu_bench(Path(workdir), args.cpu, lambda partial: write_result(partial, out), args.sections)
    write_result(result, out)
    print(format_table(result))
    print(f"-> {out}, {out.with_suffix('.txt')}")
    entry = gpu_entry(result)
    if args.throughput and entry is not None:  # a CPU run's tiny sizes are no throughput figure
        print(f"-> {write_throughput(entry, args.throughput)} (this GPU's throughput)")


if __name__ == "__main__":
    main()
