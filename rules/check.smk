# Environment check without any raster: `snakemake --cores N check_environment` (not part of `all`). Its job file
# (rasterscale.jobs.files.CheckJob) holds the task, model, tiling, predict and dummy sections.
rule check_environment:
    input:
        job=paths.check_job(),
    output:
        [paths.environment_rank_file(r) for r in range(PLAN.world_size("predict"))],
    log:
        "logs/check_environment.log",
    conda:
        "../envs/environment.yaml"
    threads: PLAN.rank_threads("predict")
    resources:
        **ddp_resources("predict"),
    params:
        entry=entry_point("check_environment"),
        launcher=launcher("predict"),
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
        log_dir="logs/check_environment",
    shell:
        "{params.launcher}{params.entry} --job {input.job:q}"
        " --out-dir {params.out_dir:q} --log-dir {params.log_dir:q} > {log:q} 2>&1"
