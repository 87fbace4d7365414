# One prediction job per shard (one node each, world_size ranks); rank r of shard s writes
# results/{scene}/predict/rank-{s * world_size + r}.parquet. Shards are known from the config, so each gets
# its own rule (predict_shard_0, predict_shard_1, ...) with its own, static outputs.
for shard in range(predict_shards()):

    rule:
        name:
            f"predict_shard_{shard}"
        input:
            raster=lambda wildcards: scene_raster(wildcards.scene),
            manifest="results/{scene}/tiles.parquet",
            checkpoint=checkpoint_path(),
        output:
            shard_outputs(shard),
        log:
            f"logs/predict/{{scene}}/shard-{shard}.log",
        benchmark:
            f"benchmarks/predict/{{scene}}/shard-{shard}.tsv"
        conda:
            "../envs/environment.yaml"
        threads: rank_threads(PREDICT)
        resources:
            **ddp_resources(PREDICT),
        params:
            entry=entry_point("predict"),
            launcher=launcher(PREDICT),
            config=config_json("model", "predict"),
            shards=predict_shards(),
            shard=shard,
            out_dir=lambda wildcards, output: os.path.dirname(output[0]),
            log_dir=f"logs/predict/{{scene}}/shard-{shard}",
        shell:
            "{params.launcher}{params.entry} --raster {input.raster} --manifest {input.manifest}"
            " --checkpoint {input.checkpoint} --config {params.config:q} --out-dir {params.out_dir}"
            " --log-dir {params.log_dir} --shards {params.shards} --shard {params.shard} > {log} 2>&1"
