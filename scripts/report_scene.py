"""Entry (rule report_scene, a Snakemake ``script:``): a predicted scene's renderings for the report: its scores and
prediction profile as HTML tables, the profile's plot, and its merged output's counts (JSON, for the project map)."""

from pathlib import Path

from rasterscale.errors import run_entry
from rasterscale.tasks.registry import task_spec
from rasterscale.tools.report import render_scene
from rasterscale.workflow.plan import workflow_plan
from rasterscale.workflow.reportfiles import SCENE_FILES, scene_report

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble


def main() -> None:
    job = scene_report(workflow_plan(snakemake.config, main_process=False), snakemake.wildcards.scene)
    outputs = {key: getattr(snakemake.output, key) for key in SCENE_FILES}
    counts = render_scene(job, task_spec(job.task), outputs)
    Path(snakemake.log[0]).write_text(f"{job.scene.name}: {counts}\n")


run_entry(main)
