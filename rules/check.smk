# The environment check (rasterscale.workflow.steps.check), without any raster: `snakemake --cores N
# check_environment` (not part of `all`). Its job file (rasterscale.jobs.files.CheckJob) holds the task, model,
# tiling, predict and dummy sections.
rule check_environment:
    input:
        job=STEPS.check_environment.job_file(),
    output:
        STEPS.check_environment.outputs(),
    log:
        STEPS.check_environment.log("environment"),
    conda:
        "../envs/environment.yaml"
    threads: STEPS.check_environment.threads()
    resources:
        **STEPS.check_environment.resources(),
    params:
        entry=entry_point(STEPS.check_environment),
        launcher=launcher(STEPS.check_environment),
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
        log_dir=STEPS.check_environment.log_dir("ranks"),
    shell:
        "{params.launcher}{params.entry} --job {input.job:q}"
        " --out-dir {params.out_dir:q} --log-dir {params.log_dir:q} > {log:q} 2>&1"
