"""make bench-parse: how long Snakemake takes to parse the workflow (Snakefile + rules/common.smk, which validates
the config and checks every scene's raster, annotation and model headers at every parse) with many scenes.

``--scenes`` small tiled GeoTIFFs (256 x 256, 3-band uint8, one 256 px block, EPSG:32617) side by side on a
square grid (a survey cut into tiles: every inner border is a seam of the project) in a scene table,
every other one with a DeepForest CSV of four boxes, an untrained resnet18 model file as ``model.file``,
``predict.scenes: all`` on CPU, ``predict.scenes_per_job`` scenes a batch. Each run is a fresh process, timed from
its start to its exit (the fastest of ``--repeats``), with the CPU seconds of it and its children (less sensitive
than wall time to other work on the machine) and its peak RSS:

- ``dry_run``: the user's plan, ``snakemake -n --cores 2`` (the main process: parse, then the DAG of every job);
  the runs timed follow a first one (which writes the jobs' files), so they read the scenes' headers from the
  header cache that one wrote (``.snakemake/rasterscale/headers.sqlite``); the first is timed too (``first_dry_run``:
  every header read);
- ``job_dry``: a job's re-parse alone: the command a Slurm job runs for one job of the workflow (below), with
  ``-n``: parse and a one-job DAG, nothing run;
- ``job``: that command, run: ``python -m snakemake --snakefile ... --target-jobs tiles_batch_0:
  --allowed-rules tiles_batch_0 --cores all --force ... --mode remote``, as Snakemake 9.27 builds it
  (RealExecutor.format_job_exec, SpawnedJobArgsFactory.general_args; the profile's own flags and
  ``--wait-for-files`` left out), for ``tiles_batch_0`` (the first batch's tile manifests, one short
  process). That process's own time comes from the job's benchmark file (``job_own_s``); the rest is the
  re-parse and Snakemake's bookkeeping around the job;
- ``slurm_job``: the command snakemake-executor-plugin-slurm 2.8 hands to sbatch (``job``'s with ``--executor
  slurm-jobstep --jobs 1``): that process parses the workflow, then its slurm-jobstep executor runs ``job``'s
  command under ``srun -n1`` (any job without an ``mpi`` resource), which parses it again. Here ``srun`` is a shim
  that drops its options and runs the command in place: two parses and the job, without Slurm.

``--mode subprocess`` is not timed: Snakemake's local executor spawns it only for ``run:`` jobs, and this
workflow has none (its ``shell:`` and ``script:`` jobs run from the main process's threads), so no local run
re-parses the workflow.

Where the parse goes: ``job_dry`` once more under cProfile (``python -m cProfile -m snakemake``): the cumulative
seconds of ``build_plan`` (rasterscale/workflow/checks.py: every scene's header checks) and of the checks inside it,
or of ``load_plan`` where a job loads the plan the main process stored,
and of the config validation and model header, against the profiled run's total. The profiler slows Python calls
more than GDAL's and the imports' C code, so its seconds are not the unprofiled ones and its shares are estimates.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import pstats
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import rasterio
import yaml
from affine import Affine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

from rasterscale.jobs.paths import RunPaths  # noqa: E402
from synthetic import TRANSFORM, write_detector, write_raster  # noqa: E402

SIDE = 256
RUN = RunPaths("model")  # the run of model.file model.pt (no model.name: the file's stem): results/model/
JOB = "tiles_batch_0"  # the timed job: one short process writing the first batch's tile manifests
MODES = ("dry_run", "job_dry", "job", "slurm_job")
WHAT = {
    "dry_run": "snakemake -n --cores 2: the user's plan (parse, DAG of {jobs} jobs)",
    "job_dry": "a job's re-parse: its --mode remote command with -n (parse, one-job DAG)",
    "job": "the job's --mode remote command, run ({job} itself {own:.2f} s, the rest {rest:.2f} s)",
    "slurm_job": "sbatch's command: slurm-jobstep, then `job` under srun (two parses)",
}
# srun stand-in for slurm_job: drops srun's options (all --key=value or -n1) and runs the command in place
SRUN = """#!/bin/sh
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
printf '%s\\n' "$*" > "$(dirname "$0")/srun-command.txt"
exec "$@"
"""
# the functions whose cumulative time the profile reports: (label, file suffix, function name)
PROFILED = (
    ("build_plan", "rasterscale/workflow/checks.py", "build_plan"),  # the main process's: every check
    ("load_plan", "rasterscale/workflow/storage.py", "load_plan"),  # a job's: the stored plan
    ("check_raster", "rasterscale/raster/headers.py", "check_raster"),
    ("check_imagery", "rasterscale/raster/imagery.py", "check_imagery"),
    ("striped_sources", "rasterscale/raster/cog.py", "striped_sources"),
    ("check_annotations", "rasterscale/tasks/detection/spec.py", "check_annotations"),
    ("validate_config", "rasterscale/config/schema.py", "validate_config"),
    ("labels", "rasterscale/tasks/detectors/spec.py", "labels"),
    ("import torch", "torch/__init__.py", "<module>"),  # inside labels: a .pt model file's header
)


def config(model_file: Path, scenes_per_job: int) -> dict[str, Any]:
    return {
        "scenes": "scenes.tsv",
        "model": {"backbone": "resnet18", "file": str(model_file)},
        "predict": {"scenes": "all", "accelerator": "cpu", "scenes_per_job": scenes_per_job},
    }


def place(path: Path, index: int, count: int) -> None:
    """Move a raster to its place in a survey: scenes abut on a square grid of ``ceil(sqrt(count))`` columns, as
    a survey cut into tiles does (every inner border a seam of the project)."""
    columns = math.ceil(math.sqrt(count))
    row, column = divmod(index, columns)
    with rasterio.open(path, "r+") as dst:
        dst.transform = Affine.translation(column * SIDE * TRANSFORM.a, row * SIDE * TRANSFORM.e) * TRANSFORM


def write_scenes(workdir: Path, count: int) -> int:
    """``count`` rasters (one written, the rest copies) side by side on a grid, a DeepForest CSV for every other
    one, the scene table; returns the number of scenes with annotations."""
    rasters, boxes = workdir / "rasters", workdir / "annotations"
    rasters.mkdir(parents=True)
    boxes.mkdir()
    first = write_raster(rasters / "scene_0000.tif", SIDE, block=SIDE)
    rows = []
    for index in range(count):
        name = f"scene_{index:04d}"
        raster = rasters / f"{name}.tif"
        if index:
            shutil.copyfile(first, raster)
            place(raster, index, count)
        annotations = ""
        if index % 2 == 0:
            annotations = f"annotations/{name}.csv"
            with open(workdir / annotations, "w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(["image_path", "xmin", "ymin", "xmax", "ymax", "label"])
                writer.writerows([raster.name, 20 + 50 * k, 30, 50 + 50 * k, 70, "tree"] for k in range(4))
        rows.append([name, f"rasters/{name}.tif", annotations])
    with open(workdir / "scenes.tsv", "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(["name", "path", "annotations"])
        writer.writerows(rows)
    return (count + 1) // 2


def snakemake(workdir: Path, *args: str) -> list[str]:
    """A snakemake command on the bench's workflow and config, run in the working directory."""
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    return [*command, "--configfiles", str(workdir / "config.yaml"), *args]


def job_command(workdir: Path, *extra: str) -> list[str]:
    """What a Slurm job's srun step runs for the timed job (Snakemake 9.27's spawned job arguments, less the
    profile's settings and --wait-for-files)."""
    command = snakemake(workdir, "--target-jobs", f"{JOB}:", "--allowed-rules", JOB, "--cores", "all")
    command += ["--attempt", "1", "--force-use-threads", "--force", "--target-files-omit-workdir-adjustment"]
    command += ["--max-inventory-time", "0", "--retries", "0", "--nocolor", "--no-hooks", "--nolock"]
    command += ["--ignore-incomplete", "--rerun-triggers", "input", "software-env", "params", "mtime", "code"]
    return [*command, "--latency-wait", "5", *extra, "--mode", "remote"]


def cpu_seconds() -> float:
    """User + system seconds of this process's finished children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


PEAK_RSS: dict[str, list[float]] = {}  # mode -> the peak RSS (MiB) of each run's process
TIME = shutil.which("time") or "/usr/bin/time"  # GNU time: the peak RSS of the process it runs (%M, KiB)


def run(
    command: list[str], workdir: Path, env: dict[str, str] | None = None, mode: str = ""
) -> tuple[float, float, str]:
    """Wall seconds of one process from start to exit, the CPU seconds of it and its children, and its output;
    a failure stops the bench. With ``mode``, the process runs under GNU time, whose peak RSS of it (a process
    forked from this one would inherit this one's peak) goes to PEAK_RSS[mode]."""
    measured = mode and Path(TIME).exists()
    full = [TIME, "-f", "rasterscale-bench-rss %M", *command] if measured else command
    cpu, started = cpu_seconds(), time.perf_counter()
    result = subprocess.run(full, capture_output=True, text=True, check=False, cwd=workdir, env=env)
    wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed in {workdir}:\n{result.stderr[-4000:]}")
    found = re.search(r"^rasterscale-bench-rss (\d+)$", result.stderr, re.MULTILINE)
    if found:
        PEAK_RSS.setdefault(mode, []).append(int(found.group(1)) / 1024)
    return wall, cpu, result.stdout + result.stderr


def job_own_seconds(workdir: Path) -> float:
    """The timed job's own process wall time (Snakemake's benchmark file of it)."""
    with open(workdir / "benchmarks/tiles/batch-0.tsv") as handle:
        return float(next(csv.DictReader(handle, delimiter="\t"))["s"])


def profile(workdir: Path) -> dict[str, Any]:
    """Cumulative seconds of the parse's checks in a job_dry run under cProfile, and the run's total."""
    out = workdir / "job_dry.prof"
    run([sys.executable, "-m", "cProfile", "-o", str(out), *job_command(workdir, "-n")[1:]], workdir)
    stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    cumulative = {}
    for label, suffix, function in PROFILED:
        found = [
            cum for (path, _, name), (_, _, _, cum, _) in stats.items() if name == function and path.endswith(suffix)
        ]
        cumulative[label] = round(max(found), 2) if found else None
    total = max(cum for _, _, _, cum, _ in stats.values())
    return {"total_s": round(total, 2), "cumulative_s": cumulative}


def measure(workdir: Path, repeats: int) -> dict[str, Any]:
    """Every mode ``repeats`` times in a prepared working directory; the fastest of each, and the profile."""
    shim = workdir / "shim"
    shim.mkdir()
    (shim / "srun").write_text(SRUN)
    (shim / "srun").chmod(0o755)
    slurm_env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    commands = {
        "dry_run": snakemake(workdir, "-n", "--cores", "2"),
        "job_dry": job_command(workdir, "-n"),
        "job": job_command(workdir),
        "slurm_job": job_command(workdir, "--executor", "slurm-jobstep", "--jobs", "1"),
    }
    # the job's inputs: the plan's job files (the main process writes them before the DAG, a dry run too); the
    # first dry run, which reads every header (the later ones read them from the header cache it writes)
    first_wall, first_cpu, _ = run(commands["dry_run"], workdir)
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpus: dict[str, list[float]] = {mode: [] for mode in MODES}
    own: list[float] = []
    jobs = 0
    for _ in range(repeats):
        for mode, command in commands.items():
            wall, cpu, output = run(command, workdir, slurm_env if mode == "slurm_job" else None, mode)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            if mode == "dry_run":
                jobs = int(re.search(r"^total\s+(\d+)", output, re.MULTILINE).group(1))  # type: ignore[union-attr]
            if mode == "job":
                own.append(job_own_seconds(workdir))
        for manifest in workdir.glob(f"{RUN.root}/*/tiles.parquet"):  # the job's outputs: each repeat plans the same
            manifest.unlink()
    best = {mode: min(values) for mode, values in walls.items()}
    shown = {mode: shlex.join(command).replace(str(workdir), "WORKDIR") for mode, command in commands.items()}
    shown["slurm_job srun step"] = (shim / "srun-command.txt").read_text().strip().replace(str(workdir), "WORKDIR")
    return {
        "wall_s": {mode: round(value, 2) for mode, value in best.items()},
        "all_wall_s": {mode: [round(v, 2) for v in values] for mode, values in walls.items()},
        "cpu_s": {mode: round(min(values), 2) for mode, values in cpus.items()},
        "job_own_s": round(own[walls["job"].index(best["job"])], 2),
        "first_dry_run_s": {"wall": round(first_wall, 2), "cpu": round(first_cpu, 2)},
        "peak_rss_mib": {mode: round(max(PEAK_RSS[mode])) if mode in PEAK_RSS else None for mode in MODES},
        "dry_run_jobs": jobs,
        "profile": profile(workdir),
        "commands": shown,
    }


def format_table(results: dict[str, Any]) -> str:
    sizes, wall = results["sizes"], results["wall_s"]
    scenes = sizes["scenes"]
    lines = [
        f"workflow parse time: {scenes} scenes of {SIDE}x{SIDE} px ({sizes['annotated']} with a CSV of boxes), "
        f"scenes_per_job {sizes['scenes_per_job']}, Snakemake {results['snakemake']}, fastest of {sizes['repeats']} "
        f"(load average {results['load_average']['before']:.1f} before, {results['load_average']['after']:.1f} after)",
        f"{'run':<10} {'wall s':>7} {'ms/scene':>8} {'CPU s':>6} {'RSS MiB':>7}  what",
    ]
    own = results["job_own_s"]
    fill = {"jobs": results["dry_run_jobs"], "job": JOB, "own": own, "rest": wall["job"] - own}
    first = results["first_dry_run_s"]
    lines.append(
        f"{'first_dry':<10} {first['wall']:>7.2f} {1000 * first['wall'] / scenes:>8.1f} {first['cpu']:>6.2f} "
        f"{'':>7}  the first snakemake -n in the folder: every header read (dry_run's read none: the header cache)"
    )
    for mode in MODES:
        lines.append(
            f"{mode:<10} {wall[mode]:>7.2f} {1000 * wall[mode] / scenes:>8.1f} {results['cpu_s'][mode]:>6.2f} "
            f"{results['peak_rss_mib'][mode]:>7}  "
            f"{WHAT[mode].format(**fill)}"
        )
    prof = results["profile"]
    total, cums = prof["total_s"], prof["cumulative_s"]
    shares = ", ".join(
        f"{label} {cum:.2f} s ({100 * cum / total:.0f}%)" for label, cum in cums.items() if cum is not None
    )
    lines.append(f"job_dry under cProfile, {total:.2f} s: {shares}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", type=int, default=1000)
    parser.add_argument("--scenes-per-job", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode; the fastest is kept")
    parser.add_argument("--out", default=str(REPO / "results/bench-parse.json"))
    parser.add_argument("--workdir", help="scratch folder, kept (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir).resolve()
            if workdir.exists() and any(workdir.iterdir()):
                parser.error(f"--workdir {workdir} is not empty")
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rasterscale-parse-")))
        model_file = write_detector(workdir / "model.pt", backbone="resnet18", patch_size=SIDE)
        annotated = write_scenes(workdir, args.scenes)
        (workdir / "config.yaml").write_text(yaml.safe_dump(config(model_file, args.scenes_per_job)))
        results: dict[str, Any] = {
            "sizes": {
                "scenes": args.scenes,
                "annotated": annotated,
                "side": SIDE,
                "scenes_per_job": args.scenes_per_job,
                "repeats": args.repeats,
            },
            "snakemake": metadata.version("snakemake"),
            "config": config(Path("model.pt"), args.scenes_per_job),
            "load_average": {"before": os.getloadavg()[0]},
        }
        results.update(measure(workdir, args.repeats))
        results["load_average"]["after"] = os.getloadavg()[0]
    table = format_table(results)
    results["table"] = table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
