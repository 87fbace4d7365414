# Training, with DDP over the job's ranks; its job file (rasterscale.jobs.files.TrainJob) holds the training scenes
# and the task, model, tiling and train sections with the training scenes' entries.
rule train_model:
    input:
        unpack(lambda wildcards: PLAN.train_start_inputs()),
        rasters=PLAN.raster_inputs(*PLAN.train_scenes),
        annotations=[PLAN.scene_annotations(name) for name in PLAN.train_scenes],
        manifests=PLAN.manifest_inputs(PLAN.train_scenes),
        job=PATHS.job_file("train"),
    output:
        **training_outputs("{model}"),
    log:
        "logs/train/{model}.log",
    benchmark:
        "benchmarks/train/{model}.tsv"
    conda:
        "../envs/environment.yaml"
    threads: PLAN.rank_threads("train")
    resources:
        **ddp_resources("train"),
    params:
        entry=entry_point("train"),
        launcher=launcher("train"),
        log_dir="logs/train/{model}",
    shell:
        "{params.launcher}{params.entry} --job {input.job:q}"
        " --model {output.model:q} --metrics {output.metrics:q} --plot {output.plot:q} --log-dir {params.log_dir:q}"
        " > {log:q} 2>&1"
