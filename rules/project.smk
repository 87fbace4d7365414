# The project's layers (results/{run}/project/), when a run predicts several scenes: every scene's and seam's
# merged layers into one, each object kept once (rasterscale/grid/project.py); its job file
# (rasterscale.jobs.files.ProjectJob) lists the sources, their footprints and the seams' cores. A task of objects
# with more predicted scenes than project.partition_scenes writes a partitioned GeoParquet layer instead: one job
# a batch, each writing its batch's sources' objects, read beside their neighbours' (rasterscale/grid/partitions.py;
# which partitions, and what each depends on: rasterscale/workflow/partitions.py). Then the summary raster.
from rasterscale.workflow import partitions

if partitions.partitioned(PLAN):

    rule project_partition:
        input:
            job=PATHS.job_file("project", "{batch}"),
            layers=lambda wildcards: partitions.partition_inputs(PLAN, int(wildcards.batch)),
        output:
            partitions.partition_file(PLAN, "{batch}"),
        log:
            "logs/project/partition-{batch}.log",
        benchmark:
            "benchmarks/project/partition-{batch}.tsv"
        wildcard_constraints:
            batch=r"\d+",
        conda:
            "../envs/environment.yaml"
        resources:
            mem_mb=scene_mem_mb("partition", "batch"),
        params:
            entry=entry_point("project"),
        shell:
            "{params.entry} --job {input.job:q} > {log:q} 2>&1"

else:

    rule project_layers:
        input:
            job=PATHS.job_file("project"),
            layers=lambda wildcards: PLAN.project_inputs(),
        output:
            **PLAN.project_outputs(),
        log:
            "logs/project/merge.log",
        benchmark:
            "benchmarks/project/merge.tsv"
        conda:
            "../envs/environment.yaml"
        resources:
            mem_mb=mem_mb("project"),
        params:
            entry=entry_point("project"),
        shell:
            "{params.entry} --job {input.job:q} > {log:q} 2>&1"


# The project's summary raster (rasterscale/raster/summary.py): a COG of project.summary_cell, objects per hectare
# (or class cover, or mean value), read from the layer without loading it whole; the report's project map.
rule project_summary:
    input:
        job=PATHS.job_file("summary"),
        layers=lambda wildcards: partitions.summary_layers(PLAN),
    output:
        partitions.summary_file(PLAN),
    log:
        "logs/project/summary.log",
    benchmark:
        "benchmarks/project/summary.tsv"
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=mem_mb("project"),
    params:
        entry=entry_point("project_summary"),
    shell:
        "{params.entry} --job {input.job:q} > {log:q} 2>&1"
