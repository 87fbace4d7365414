"""Entry (rules score_batch_{b}, a Snakemake ``script:``): each predicted scene of a batch, as its job file lists them,
scored against its annotations (evaluation.json and quicklook) or drawn without them, and its pages for the
report."""

from pathlib import Path

from rasterscale.atomic import write_json
from rasterscale.errors import run_entry
from rasterscale.jobs.files import ScoreJob
from rasterscale.tools.evaluate import score_batch

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble


def main() -> None:
    lines = score_batch(ScoreJob.read(snakemake.input.job))
    Path(snakemake.log[0]).write_text("".join(line + "\n" for line in lines))
    write_json({"outputs": list(snakemake.output.files)}, snakemake.output.record)  # last: the batch is scored


run_entry(main)
