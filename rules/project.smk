# The project step (rasterscale.workflow.steps.project): the project's layers (results/{run}/project/), when a run
# predicts several scenes: every scene's and seam's merged layers into one, each object kept once
# (rasterscale/grid/project.py); its job file (rasterscale.jobs.files.ProjectJob) lists the sources, their footprints
# and the seams' cores. A task of objects with more predicted scenes than project.partition_scenes writes a
# partitioned GeoParquet layer instead: one job a batch, each writing its batch's sources' objects, read beside their
# neighbours' (rasterscale/grid/partitions.py; which partitions, and what each depends on:
# rasterscale/workflow/partitions.py). Then the summary step.
if STEPS.project.partitioned():

    rule project_partition:
        input:
            job=STEPS.project.job_file("{batch}"),
            layers=lambda wildcards: STEPS.project.partition_inputs(int(wildcards.batch)),
        output:
            STEPS.project.partition_output(),
        log:
            STEPS.project.log("partition-{batch}"),
        benchmark:
            STEPS.project.benchmark("partition-{batch}")
        wildcard_constraints:
            batch=r"\d+",
        conda:
            "../envs/environment.yaml"
        resources:
            **STEPS.project.partition_resources(),
        params:
            entry=entry_point(STEPS.project),
        shell:
            "{params.entry} --job {input.job:q} > {log:q} 2>&1"

else:

    rule project:
        input:
            job=STEPS.project.job_file(),
            layers=lambda wildcards: STEPS.project.inputs(),
        output:
            **STEPS.project.outputs(),
        log:
            STEPS.project.log("merge"),
        benchmark:
            STEPS.project.benchmark("merge")
        conda:
            "../envs/environment.yaml"
        resources:
            **STEPS.project.resources(),
        params:
            entry=entry_point(STEPS.project),
        shell:
            "{params.entry} --job {input.job:q} > {log:q} 2>&1"


# The summary step (rasterscale.workflow.steps.summary): the project's summary raster (rasterscale/raster/summary.py),
# a COG of project.summary_cell, objects per hectare (or class cover, or mean value), read from the layer without
# loading it whole; the report's project map.
rule summary:
    input:
        job=STEPS.summary.job_file(),
        layers=lambda wildcards: STEPS.summary.inputs(),
    output:
        STEPS.summary.output(),
    log:
        STEPS.summary.log("summary"),
    benchmark:
        STEPS.summary.benchmark("summary")
    conda:
        "../envs/environment.yaml"
    resources:
        **STEPS.summary.resources(),
    params:
        entry=entry_point(STEPS.summary),
    shell:
        "{params.entry} --job {input.job:q} > {log:q} 2>&1"
