"""Running the real workflow in a scratch directory (used by the integration tests)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import geopandas as gpd
import numpy as np
import shapely
import yaml

import snakemake_forks
from conftest import REPO
from rasterscale.config.schema import default_model_name
from rasterscale.jobs.paths import RunPaths
from rasterscale.raster.geo import box_pairs, pair_ious
from rasterscale.tasks.detectors.merge import BOX_COLUMNS

TINY = REPO / "tests/configs/tiny.yaml"


def tiny_config(**overrides: dict) -> dict:
    config = yaml.safe_load(TINY.read_text())
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def run_name(config: dict) -> str:
    """The run a config's outputs are keyed by (``results/{run}/``): model.name, or what validation fills in when
    it is unset (a model file's stem, else the task's default)."""
    model = config.get("model") or {}
    return model.get("name") or default_model_name(config.get("task", "detection"), model.get("file") or "")


def run_paths(config: dict) -> RunPaths:
    """The paths of a config's run's outputs, relative to its working directory."""
    return RunPaths(run_name(config))


def run_dir(workdir: Path, config: dict) -> Path:
    """The folder of a config's run's outputs in ``workdir``: ``results/{run}/``."""
    return workdir / run_paths(config).root


def workflow_command(workdir: Path, config: dict, *args: str) -> list[str]:
    """The snakemake command that runs the real workflow on ``config`` in ``workdir`` (config written there)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(config_path),
        *args,
    ]


def run_workflow(
    workdir: Path, config: dict, *args: str, timeout: int = 600, fork_jobs: bool = True
) -> subprocess.CompletedProcess:
    """Run the workflow locally on 2 cores; a failure raises with the tails of every log. ``fork_jobs``: its jobs
    forked from the worker's zygote (tests/job_forks.py); False where a plain command runs the folder again."""
    command = workflow_command(workdir, config, "--cores", "2", *args)
    result = snakemake_forks.run(command, timeout=timeout, fork_jobs=fork_jobs)
    if result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("logs/**/*.log")))
        raise AssertionError(f"workflow failed ({result.returncode}):\n{result.stderr[-4000:]}\n{logs}")
    return result


def jobs_planned(workdir: Path, config: dict, *targets: str) -> dict[str, int]:
    """The jobs a dry run of ``config`` in ``workdir`` plans (towards ``targets``, else rule all), by rule."""
    result = snakemake_forks.run(workflow_command(workdir, config, "-n", *targets), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if "Nothing to be done" in result.stdout + result.stderr:
        return {}
    table = result.stdout.split("Job stats:")[1].split("total")[0]
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.M)}


def matched_fraction(a: gpd.GeoDataFrame, b: gpd.GeoDataFrame, min_iou: float) -> float:
    """Fraction of boxes of ``a`` with a box of ``b`` at IoU >= min_iou (one-to-one not required)."""
    boxes_a, boxes_b = a[BOX_COLUMNS].to_numpy(float), b[BOX_COLUMNS].to_numpy(float)
    i, j = box_pairs(boxes_a, boxes_b)
    good = np.zeros(len(boxes_a), dtype=bool)
    good[i[pair_ious(boxes_a[i], boxes_b[j]) >= min_iou]] = True
    return float(good.mean()) if len(good) else 1.0


def matched_polygons(a: gpd.GeoDataFrame, b: gpd.GeoDataFrame, min_iou: float) -> float:
    """Fraction of the crowns of ``a`` with a crown of ``b`` of the same label at polygon IoU >= ``min_iou``."""
    pa, pb = np.asarray(a.geometry.array), np.asarray(b.geometry.array)
    i, j = shapely.STRtree(pb).query(pa, predicate="intersects")
    inter = shapely.area(shapely.intersection(pa[i], pb[j]))
    iou = inter / (shapely.area(pa[i]) + shapely.area(pb[j]) - inter)
    same = a["label"].to_numpy()[i] == b["label"].to_numpy()[j]
    good = np.zeros(len(pa), dtype=bool)
    good[i[(iou >= min_iou) & same]] = True
    return float(good.mean()) if len(good) else 1.0


def rank_stems(run: Path, scene: str, suffix: str = ".parquet") -> list[Path]:
    """A scene's rank files (paths without suffix) under a run's folder ``run`` (``results/{run}/``, as
    :func:`run_dir` gives it), in its predict/batch-*/shard-*/, in rank order; each has its output ``{stem}{suffix}``
    beside its record ``{stem}.json``."""
    outputs = (run / "predict").glob(f"batch-*/shard-*/{scene}/rank-*{suffix}")
    stems = [path.with_suffix("") for path in outputs]
    return sorted(stems, key=lambda stem: int(stem.name.split("-")[1]))


def rank_tile_ids(run: Path, scene: str) -> list[list[int]]:
    """Each rank's processed tile_ids of a scene (from its record) under a run's folder, in rank order."""
    from rasterscale.jobs.rankfiles import read_tile_ids

    return [read_tile_ids(stem).tolist() for stem in rank_stems(run, scene)]


@dataclass
class Report:
    """A Snakemake report (the zip), unpacked: its categories (category -> subcategory -> result paths), its results
    (path -> name, labels, caption, data_uri, ...) and the folder its report.html and data lie in."""

    categories: dict[str, dict[str, list[str]]]
    results: dict[str, dict]
    folder: Path

    def items(self, category: str, subcategory: str) -> dict[str, dict]:
        """A subcategory's results by their label ``item``."""
        return {self.results[p]["labels"]["item"]: self.results[p] for p in self.categories[category][subcategory]}

    def file(self, result: dict) -> Path:
        return self.folder / result["data_uri"]


def build_report(workdir: Path, config: dict, out: Path, *args: str) -> Report:
    """Run the workflow with ``--report-after-run --report out/report.zip`` (a finished run: only the report is
    built), unzip it into ``out`` and parse what its report.html embeds."""
    run_workflow(workdir, config, "--report-after-run", "--report", str(out / "report.zip"), *args)
    with zipfile.ZipFile(out / "report.zip") as archive:
        archive.extractall(out)
    folder = out / "report"
    page = (folder / "report.html").read_text()

    def embedded(name: str) -> dict:
        found = re.search(rf'<script id="{name}">\s*var {name} = (.*?);\s*</script>', page, flags=re.S)
        assert found, f"report.html embeds no {name}"
        return json.loads(found.group(1))

    return Report(embedded("categories"), embedded("results"), folder)


def table_rows(page: str) -> list[list[str]]:
    """Every row of every table of an HTML page, as its cells' texts (header rows too)."""

    class Rows(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[str]] = []
            self.cell: list[str] | None = None

        def handle_starttag(self, tag: str, attrs: list) -> None:
            if tag == "tr":
                self.rows.append([])
            elif tag in ("td", "th"):
                self.cell = []

        def handle_endtag(self, tag: str) -> None:
            if tag in ("td", "th") and self.cell is not None:
                self.rows[-1].append("".join(self.cell).strip())
                self.cell = None

        def handle_data(self, data: str) -> None:
            if self.cell is not None:
                self.cell.append(data)

    parser = Rows()
    parser.feed(page)
    return parser.rows


def browser() -> str | None:
    """A Chromium on the PATH (Debian's chromium, or Chrome), or None."""
    return next(
        (path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))), None
    )


def rendered_dom(page: Path, script: str = "") -> str:
    """What a Snakemake report's app drew (its element ``#app`` in the DOM) once a headless Chromium has run the
    page's scripts and then ``script`` (JavaScript run after the page loaded, from a copy of the page beside it)."""
    if script:
        text = page.read_text()
        end = text.rfind("</body>")
        inject = f"<script>window.addEventListener('load', () => setTimeout(() => {{ {script} }}, 200));</script>"
        page = page.with_name(f"{page.stem}.scripted.html")
        page.write_text(text[:end] + inject + text[end:])
    command = [str(browser()), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    result = subprocess.run([*command, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    app = result.stdout[result.stdout.index('id="app"') :]  # what the page's app drew, not its scripts' data
    return app[: app.find("<script")] if "<script" in app else app
