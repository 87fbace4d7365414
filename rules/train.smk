rule train_model:
    input:
        unpack(train_start_inputs),
        rasters=[scene_raster(name) for name in TRAIN["scenes"]],
        annotations=[scene_annotations(name) for name in TRAIN["scenes"]],
        manifests=[f"results/{name}/tiles.parquet" for name in TRAIN["scenes"]],
    output:
        **trained_model_outputs("{model}"),
    log:
        "logs/train/{model}.log",
    benchmark:
        "benchmarks/train/{model}.tsv"
    conda:
        "../envs/environment.yaml"
    threads: rank_threads(TRAIN)
    resources:
        **ddp_resources(TRAIN),
    params:
        entry=entry_point("train"),
        launcher=launcher(TRAIN),
        scenes=training_scenes_json(),
        config=config_json("task", "model", "tiling", "train"),
        log_dir="logs/train/{model}",
    shell:
        "{params.launcher}{params.entry} --scenes {params.scenes:q} --config {params.config:q}"
        " --model {output.model:q} --metrics {output.metrics:q} --plot {output.plot:q} --log-dir {params.log_dir:q}"
        " > {log:q} 2>&1"
