"""make bench-continental: a simulated continental run (issue 30): ``--items`` scenes (200,000 by default) planned
by ``snakemake -n``, a sample of their batches run for real, with every process's time and peak RSS.

Two sources of scenes (``--source``):

- ``stac`` (default): one STAC ItemCollection of ``--items`` items, each with its own ``proj:transform`` on a
  square grid of abutting 256 x 256 scenes (a survey: every inner border a seam), ``proj:shape``, ``proj:code`` and
  ``raster:bands``; their ``visual`` hrefs (each its own path, as real items' are) are links to a few shared small
  COGs (``--shared``), except those of the sampled batches' scenes, which get a raster of their own with the
  item's transform (a sparse 256 x 256 GeoTIFF, read as zeros), so that the tile-manifest jobs' header check (the
  real header against the item's) passes. The plan trusts the items' proj metadata and opens no raster;
- ``survey``: the layout of ``bench/parse_time.py`` (a scene table of local GeoTIFFs abutting on a grid, every
  other one with a DeepForest CSV of four boxes), each raster a sparse 256 x 256 GeoTIFF of its own (396 bytes:
  a template whose tie point is rewritten per scene, so that 200,000 of them take seconds and 800 MB).

Both with an untrained resnet18 detector as ``model.file``, ``predict.scenes: all`` on CPU and
``predict.scenes_per_job`` scenes a job. Every process runs under GNU time (wall, CPU, peak RSS):

- ``first_dry_run``: the first ``snakemake -n --cores 2`` in the folder (survey: every header read; with
  ``--reuse``, the header cache's): it builds the plan and writes every job file;
- ``dry_run``: the next one, the figure of the issue's table: it reuses the stored plan and job files, as nothing
  they read changed (rasterscale.workflow.reuse);
- ``sample``: ``snakemake --cores 2`` of the first ``--sample-batches`` batches' scoring jobs (their tile manifests,
  predictions, merges and scores), whose jobs' own peak RSS come from their benchmark files;
- ``job_reparse``: then the ``--mode remote`` command of ``tiles_batch_0`` with ``-n`` (a Slurm job's
  parse: it loads its batch's plan, which the run's onstart wrote); with ``--sample-batches 0``
  ``job_reparse_whole_plan``, the same after dry runs only, which loads the whole plan.

It prints the plan's figures and the cost estimate's lines (rasterscale.workflow.estimate), and writes the results
to ``--out`` (results/bench-continental.json).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import rasterio
import yaml
from affine import Affine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

from parse_time import TIME, job_command, snakemake  # noqa: E402
from rasterscale.runtime.precision import cpu_info  # noqa: E402
from synthetic import CRS, TRANSFORM, write_detector, write_raster  # noqa: E402

SIDE = 256
TARGETS = {100_000: (150.0, 4096.0, 5.0), 200_000: (300.0, 4096.0, 5.0)}  # scenes: dry run s, RSS MiB, re-parse s


def scene_name(index: int) -> str:
    return f"scene_{index:06d}"


def grid_transform(index: int, count: int) -> Affine:
    """The transform of scene ``index`` of ``count`` abutting on a square grid (``ceil(sqrt(count))`` columns)."""
    row, column = divmod(index, math.ceil(math.sqrt(count)))
    return Affine.translation(column * SIDE * TRANSFORM.a, row * SIDE * TRANSFORM.e) * TRANSFORM


class SparseRasters:
    """Sparse 256 x 256 3-band GeoTIFFs (no block written: GDAL reads zeros) at any transform of the grid: one
    written by GDAL, the others its bytes with the tie point (ModelTiepointTag's X and Y) rewritten."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        template = folder / ".template.tif"
        write_raster(template, SIDE, only=[], block=SIDE)
        self.data = template.read_bytes()
        template.unlink()
        self.tie = struct.pack("<6d", 0, 0, 0, TRANSFORM.c, TRANSFORM.f, 0)
        if self.data.count(self.tie) != 1:
            raise RuntimeError("the template GeoTIFF's tie point is not found once in its bytes")

    def write(self, path: Path, transform: Affine) -> None:
        tie = struct.pack("<6d", 0, 0, 0, transform.c, transform.f, 0)
        path.write_bytes(self.data.replace(self.tie, tie))


def write_survey(workdir: Path, count: int) -> dict[str, Any]:
    """The survey source: a sparse raster a scene, a CSV of four boxes every other one, the scene table."""
    sparse = SparseRasters(workdir / "rasters")
    (workdir / "annotations").mkdir()
    rows = []
    for index in range(count):
        name = scene_name(index)
        sparse.write(workdir / "rasters" / f"{name}.tif", grid_transform(index, count))
        annotations = ""
        if index % 2 == 0:
            annotations = f"annotations/{name}.csv"
            boxes = "".join(f"{name}.tif,{20 + 50 * k},30,{50 + 50 * k},70,tree\n" for k in range(4))
            (workdir / annotations).write_text("image_path,xmin,ymin,xmax,ymax,label\n" + boxes)
        rows.append(f"{name}\trasters/{name}.tif\t{annotations}\n")
    (workdir / "scenes.tsv").write_text("name\tpath\tannotations\n" + "".join(rows))
    with rasterio.open(workdir / "rasters" / f"{scene_name(count - 1)}.tif") as src:  # the tie point took
        if src.transform != grid_transform(count - 1, count):
            raise RuntimeError(f"a rewritten raster's transform is {src.transform}")
    return {"scenes": "scenes.tsv"}


def stac_item(index: int, count: int, href: str) -> dict[str, Any]:
    """A STAC item of the grid's scene ``index``: proj (code, shape, transform) and raster:bands on its asset."""
    t = grid_transform(index, count)
    return {
        "type": "Feature",
        "stac_version": "1.0.0",
        "stac_extensions": [
            "https://stac-extensions.github.io/projection/v2.0.0/schema.json",
            "https://stac-extensions.github.io/raster/v1.1.0/schema.json",
        ],
        "id": scene_name(index),
        "geometry": None,
        "properties": {
            "datetime": "2024-06-01T00:00:00Z",
            "proj:code": CRS,
            "proj:shape": [SIDE, SIDE],
            "proj:transform": [t.a, t.b, t.c, t.d, t.e, t.f],
        },
        "assets": {
            "visual": {
                "href": href,
                "type": "image/tiff; application=geotiff; profile=cloud-optimized",
                "roles": ["data"],
                "raster:bands": [{"data_type": "uint8"}] * 3,
            }
        },
        "links": [],
    }


def write_stac(workdir: Path, count: int, shared: int, own: int) -> dict[str, Any]:
    """The STAC source: ``shared`` small COGs, ``own`` sparse rasters (the sampled batches' scenes), the
    ItemCollection of ``count`` items."""
    (workdir / "cogs").mkdir()
    for k in range(shared):
        write_raster(workdir / "cogs" / f"shared_{k}.tif", SIDE, block=SIDE)
    sparse = SparseRasters(workdir / "own")
    (workdir / "links").mkdir()
    features = []
    for index in range(count):
        name = scene_name(index)
        if index < own:
            href = f"own/{name}.tif"
            sparse.write(workdir / href, grid_transform(index, count))
        else:  # a path of its own (as every real item's href is), a link to a shared COG
            href = f"links/{name}.tif"
            os.symlink(f"../cogs/shared_{index % shared}.tif", workdir / href)
        features.append(stac_item(index, count, href))
    collection = {"type": "FeatureCollection", "features": features}
    (workdir / "items.json").write_text(json.dumps(collection, separators=(",", ":")))
    return {"scenes": {}, "stac": {"items": ["items.json"], "asset": "visual"}}


def bench_config(scenes: dict[str, Any], scenes_per_job: int) -> dict[str, Any]:
    return {
        **scenes,
        "model": {"backbone": "resnet18", "file": "model.pt"},
        "predict": {"scenes": "all", "accelerator": "cpu", "scenes_per_job": scenes_per_job},
    }


def timed(command: list[str], workdir: Path, timeout: float) -> dict[str, Any]:
    """One process under GNU time: wall and CPU seconds (it and its children), peak RSS (MiB), its output."""
    started = time.perf_counter()
    full = [TIME, "-f", "rasterscale-bench %U %S %M", *command]
    try:
        result = subprocess.run(full, capture_output=True, text=True, cwd=workdir, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"continental: {shlex.join(command)} ran over {timeout:.0f} s in {workdir}") from None
    found = re.search(r"^rasterscale-bench ([\d.]+) ([\d.]+) (\d+)$", result.stderr, re.MULTILINE)
    if result.returncode != 0 or found is None:
        output = (result.stdout[-3000:] + result.stderr[-3000:]).strip()
        raise SystemExit(f"continental: {shlex.join(command)} failed in {workdir}:\n{output}")
    user, system, rss = found.groups()
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(float(user) + float(system), 2),
        "peak_rss_mib": round(int(rss) / 1024),
        "output": result.stdout + result.stderr,
    }


def job_counts(output: str) -> dict[str, int]:
    """The dry run's job stats table: jobs by rule, and the total."""
    counts = {rule: int(n) for rule, n in re.findall(r"^(\S+)\s+(\d+)$", output, re.MULTILINE)}
    batches = sum(n for rule, n in counts.items() if rule.startswith("tiles_batch_"))
    return {"total": counts.get("total", 0), "batches": batches}


def benchmark_rss(workdir: Path) -> list[dict[str, Any]]:
    """Every job's own process as its benchmark file records it: wall seconds, CPU seconds, peak RSS (MiB)."""
    jobs = []
    for path in sorted((workdir / "benchmarks").rglob("*.tsv")):
        with open(path) as handle:
            row = next(csv.DictReader(handle, delimiter="\t"))
        jobs.append(
            {
                "job": str(path.relative_to(workdir / "benchmarks").with_suffix("")),
                "wall_s": round(float(row["s"]), 2),
                "cpu_s": round(float(row["cpu_time"]), 2),
                "peak_rss_mib": round(float(row["max_rss"])) if row["max_rss"] not in ("", "NA") else None,
            }
        )
    return jobs


def measure(workdir: Path, sample_batches: int, timeout: float) -> dict[str, Any]:
    dry = snakemake(workdir, "-n", "--cores", "2")
    runs = {"first_dry_run": timed(dry, workdir, timeout), "dry_run": timed(dry, workdir, timeout)}
    output = runs["dry_run"]["output"]
    results: dict[str, Any] = {
        "estimate": [line for line in output.splitlines() if line.startswith("rasterscale: ")],
        "jobs": job_counts(output),
    }
    if sample_batches:
        targets = [f"score_batch_{b}" for b in range(sample_batches)]
        runs["sample"] = timed(snakemake(workdir, "--cores", "2", *targets), workdir, timeout)
        results["sample_jobs"] = benchmark_rss(workdir)
    # after a run, whose onstart wrote the batches' plans, a job loads its batch's; after dry runs only, the whole
    runs["job_reparse" if sample_batches else "job_reparse_whole_plan"] = timed(
        job_command(workdir, "-n"), workdir, timeout
    )
    results["processes"] = {name: {k: v for k, v in run.items() if k != "output"} for name, run in runs.items()}
    return results


def format_report(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    lines = [
        f"continental: {sizes['items']:,} scenes ({sizes['source']}), scenes_per_job {sizes['scenes_per_job']}, "
        f"{results['jobs']['batches']:,} batches, {results['jobs']['total']:,} jobs in the dry run; "
        f"{results['cpu']}, load {results['load_average']['before']:.1f} before, "
        f"{results['load_average']['after']:.1f} after; inputs written in {sizes['written_s']:.0f} s",
        *results["estimate"],
        f"{'process':<14} {'wall s':>8} {'CPU s':>8} {'peak RSS MiB':>12}",
    ]
    for name, run in results["processes"].items():
        lines.append(f"{name:<14} {run['wall_s']:>8.2f} {run['cpu_s']:>8.2f} {run['peak_rss_mib']:>12}")
    for job in results.get("sample_jobs", []):
        lines.append(f"  job {job['job']:<32} {job['wall_s']:>8.2f} {job['cpu_s']:>8.2f} {job['peak_rss_mib']!s:>12}")
    target = TARGETS.get(sizes["items"])
    if target is not None:
        processes = results["processes"]

        def verdict(name: str, seconds: float, mib: float = 0) -> str:
            run = processes.get(name)
            if run is None:
                return f"{name} not measured"
            return f"{name} {'met' if run['wall_s'] <= seconds and run['peak_rss_mib'] <= mib else 'NOT met'}"

        lines.append(
            f"targets (dry run <= {target[0]:.0f} s, <= {target[1] / 1024:.0f} GiB, re-parse <= {target[2]:.0f} s): "
            + ", ".join(
                [
                    verdict("first_dry_run", target[0], target[1]),
                    verdict("dry_run", target[0], target[1]),
                    verdict("job_reparse", target[2], float("inf")),  # a job's, after a run (--sample-batches)
                ]
            )
        )
    return "\n".join(lines)


def cpu_name() -> str:
    return f"{os.cpu_count()} x {cpu_info()[0]}"


def write_inputs(workdir: Path, args: argparse.Namespace) -> None:
    """The model file, the scenes of ``--source`` and the config."""
    write_detector(workdir / "model.pt", backbone="resnet18", patch_size=SIDE)
    if args.source == "stac":
        scenes = write_stac(workdir, args.items, args.shared, args.sample_batches * args.scenes_per_job)
    else:
        scenes = write_survey(workdir, args.items)
    (workdir / "config.yaml").write_text(yaml.safe_dump(bench_config(scenes, args.scenes_per_job)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=200_000, help="scenes (STAC items)")
    parser.add_argument("--source", choices=("stac", "survey"), default="stac")
    parser.add_argument("--scenes-per-job", type=int, default=64)
    parser.add_argument("--sample-batches", type=int, default=2, help="batches run for real (0: dry runs only)")
    parser.add_argument("--shared", type=int, default=4, help="shared COGs the STAC items point at")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a process may take")
    parser.add_argument("--out", default=str(REPO / "results/bench-continental.json"))
    parser.add_argument("--workdir", help="scratch folder, kept (default: a temporary one, removed afterwards)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="plan the inputs an earlier run wrote into --workdir again (its outputs "
        "and stored plans removed, its header cache kept: the first dry run reads no header)",
    )
    args = parser.parse_args()
    if args.workdir:
        workdir = Path(args.workdir).resolve()
        if workdir.exists() and any(workdir.iterdir()) and not args.reuse:
            parser.error(f"--workdir {workdir} is not empty")
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="rasterscale-continental-"))
    try:
        started = time.perf_counter()
        if args.reuse and (workdir / "config.yaml").exists():
            for folder in ("results", "logs", "benchmarks"):
                shutil.rmtree(workdir / folder, ignore_errors=True)
            for plan in (workdir / ".snakemake/rasterscale").glob("plan-*.json"):
                plan.unlink()
                shutil.rmtree(plan.with_suffix(""), ignore_errors=True)  # its batch plans and the main process's record
        else:
            write_inputs(workdir, args)
        sizes = {"items": args.items, "source": args.source, "scenes_per_job": args.scenes_per_job}
        sizes["written_s"] = round(time.perf_counter() - started, 1)
        results: dict[str, Any] = {"sizes": sizes, "cpu": cpu_name(), "load_average": {"before": os.getloadavg()[0]}}
        results.update(measure(workdir, args.sample_batches, args.timeout))
        results["load_average"]["after"] = os.getloadavg()[0]
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report = format_report(results)
    results["report"] = report
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(report)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
