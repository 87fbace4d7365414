# rasterscale: deep learning over large geospatial rasters, from a laptop (--cores N) to SLURM (--profile).
# Entry point; rules live in rules/, logic in the Python package scripts/rasterscale. Also a Snakemake module of
# another workflow (README.md, "Use as a Snakemake module"): every path of its own resolves from this file's folder.
from snakemake.utils import min_version

min_version("9.0")  # the 9.x line is what envs/requirements.txt pins and the workflow is tested with


# The demo's config (config/config.yaml in the working directory, as Snakemake reads every configfile), unless the
# command line gives one with --configfile: that config replaces it (Snakemake would lay it over this one key by
# key, and the demo's scenes would join the user's). As a module with `config: config`, Snakemake skips this
# directive: the module's config is the caller's alone.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/cog.smk"
include: "rules/tiles.smk"
include: "rules/train.smk"
include: "rules/predict.smk"
include: "rules/merge.smk"
include: "rules/project.smk"
include: "rules/evaluate.smk"
include: "rules/check.smk"
include: "rules/report.smk"


forget_batch_rule_functions()  # rules/common.smk: Snakemake copies the globals for every job's command


rule all:
    default_target: True
    input:
        lambda wildcards: default_targets(),


onstart:
    store_job_plans()


onsuccess:
    reports.print_evaluation_summary(PLAN)
    reports.print_predict_profiles(PLAN)
