rule train_detector:
    input:
        unpack(train_start_inputs),
        rasters=[scene_raster(name) for name in TRAIN["scenes"]],
        annotations=[scene_annotations(name) for name in TRAIN["scenes"]],
        manifests=[f"results/{name}/tiles.parquet" for name in TRAIN["scenes"]],
    output:
        checkpoint="results/models/{model}.pt",
        deepforest_config="results/models/{model}/config.json",
        deepforest_weights="results/models/{model}/model.safetensors",
        metrics="results/models/{model}.metrics.csv",
        plot="results/models/{model}.png",
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
        config=config_json("model", "tiling", "train"),
        folder=lambda wildcards, output: os.path.dirname(output.deepforest_config),
        log_dir="logs/train/{model}",
    shell:
        "{params.launcher}{params.entry} --scenes {params.scenes:q} --config {params.config:q}"
        " --checkpoint {output.checkpoint} --deepforest-folder {params.folder} --metrics {output.metrics}"
        " --plot {output.plot} --log-dir {params.log_dir} > {log} 2>&1"
