"""Entry (rules score_batch_{b}, a Snakemake ``script:``): each predicted scene of a batch scored against its
annotations (evaluation.json and quicklook) or drawn without them, and its pages for the report."""

from pathlib import Path

from rasterscale.atomic import write_json
from rasterscale.errors import run_entry
from rasterscale.tools.evaluate import score_batch
from rasterscale.workflow.storage import workflow_plan

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble


def main() -> None:
    plan = workflow_plan(snakemake.config, main_process=False)
    lines = score_batch(plan, int(snakemake.params.batch))
    Path(snakemake.log[0]).write_text("".join(line + "\n" for line in lines))
    write_json({"outputs": list(snakemake.output.files)}, snakemake.output.record)  # last: the batch is scored


run_entry(main)
