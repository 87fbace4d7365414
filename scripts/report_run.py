"""Entry (rule report_run, a Snakemake ``script:``): the report's page of the run (config, model, precision,
launch geometry) from the stored plan, the model file's training record and the scenes' prediction profiles."""

from pathlib import Path

from rasterscale.errors import run_entry
from rasterscale.tasks.modelfiles import training_meta
from rasterscale.tools.report import read_json, run_page, write_text
from rasterscale.workflow.reportfiles import run_facts
from rasterscale.workflow.storage import workflow_plan

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble


def main() -> None:
    facts = run_facts(workflow_plan(snakemake.config, main_process=False))
    meta = training_meta(facts.model_file) if facts.model_file else None
    profiles = {name: read_json(path) for name, path in facts.profiles.items()}
    write_text(run_page(facts, meta, profiles), snakemake.output[0])
    Path(snakemake.log[0]).write_text(f"{snakemake.output[0]}: {len(profiles)} scene profile(s)\n")


run_entry(main)
