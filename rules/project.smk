# The project's layers (results/{run}/project/), when a run predicts several scenes: every scene's and seam's merged
# layers into one, each object kept once (rasterscale/grid/project.py); the job file lists the sources, their
# footprints and the seams' cores.
rule project_job:
    output:
        PATHS.project_file("job.json"),
    log:
        "logs/project/job.log",
    localrule: True
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=mem_mb("job_file"),
    params:
        job=lambda wildcards: PLAN.project_job().to_json(),
    script:
        "../scripts/write_project_job.py"


rule project_layers:
    input:
        job=PATHS.project_file("job.json"),
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
