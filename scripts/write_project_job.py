"""Entry (rule project_job, a Snakemake ``script:``): write the project's job file from the rule's params."""

from rasterscale.jobs.files import ProjectJob

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble
ProjectJob.from_json(snakemake.params.job).write(snakemake.output[0])
