"""Entry (rule scene_batch, a Snakemake ``script:``): write a batch's job file from the rule's params."""

from rasterscale.workflow.jobfiles import write_job_file

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble
write_job_file(snakemake.params.job, snakemake.output[0], snakemake.log[0])
