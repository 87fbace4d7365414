"""Entry (rule scene_batch, a Snakemake ``script:``): write a batch's job file from the rule's params."""

from rasterscale.jobs.files import PredictionBatch

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble
PredictionBatch.from_json(snakemake.params.job).write(snakemake.output[0], snakemake.log[0])
