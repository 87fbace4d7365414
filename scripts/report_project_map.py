"""Entry (rule report_project_map, a Snakemake ``script:``): the project map of the report: every scene its job file
lists, its footprint from its raster's header, a predicted one filled by its merged output's count."""

from pathlib import Path

from rasterscale.errors import run_entry
from rasterscale.jobs.files import ProjectMapJob
from rasterscale.tasks.registry import task_spec
from rasterscale.tools.report import render_project_map

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble


def main() -> None:
    job = ProjectMapJob.read(snakemake.input.job)
    render_project_map(job, task_spec(job.settings.task).count_unit, snakemake.output[0])
    Path(snakemake.log[0]).write_text(f"{snakemake.output[0]}: {len(job.scenes)} scene(s)\n")


run_entry(main)
