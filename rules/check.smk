# Environment check without any raster: `snakemake --cores N check_environment` (not part of `all`).
rule check_environment:
    output:
        [f"results/checks/environment/rank-{r}.json" for r in range(world_size(PREDICT))],
    params:
        launcher=launcher(PREDICT),
        config=config_json(),
        out_dir="results/checks/environment",
        log_dir="logs/check_environment",
    threads: rank_threads(PREDICT)
    log:
        "logs/check_environment.log",
    shell:
        "{params.launcher}{PYTHON} {SCRIPTS}/check_environment.py --config {params.config:q}"
        " --out-dir {params.out_dir} --log-dir {params.log_dir} > {log} 2>&1"
