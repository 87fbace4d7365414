# The project's layers (results/{run}/project/), when a run predicts several scenes: every scene's and seam's merged
# layers into one, each object kept once (rasterscale/grid/project.py); its job file (rasterscale.jobs.files.ProjectJob)
# lists the sources, their footprints and the seams' cores.
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
