# A batch's job file: its scenes' rasters, manifests, rank files and merged outputs (common.smk: batch_job), the
# jobs' inputs, read from a file rather than a command line that would grow with the batch.
rule scene_batch:
    output:
        batch_file("{batch}"),
    log:
        "logs/scene_batch/batch-{batch}.log",
    localrule: True
    params:
        job=lambda wildcards: batch_job(wildcards.batch),
    run:
        write_batch_file(params.job, output[0], log[0])


# One prediction job per (batch, shard), on one node with world_size ranks: it loads the model once and predicts
# every scene of the batch; rank r of shard s writes results/{scene}/predict/rank-{s * world_size + r}.parquet
# for each scene. Batches and shards are known from the config, so each pair gets its own rule
# (predict_batch_0_shard_0, predict_batch_0_shard_1, ...) with its own, static outputs.
for batch, names in enumerate(BATCHES):
    for shard in range(predict_shards()):

        rule:
            name:
                f"predict_batch_{batch}_shard_{shard}"
            input:
                **batch_inputs(batch),
                job=batch_file(batch),
                checkpoint=checkpoint_path(),
            output:
                [path for name in names for path in scene_rank_files(name, shard)],
            log:
                f"logs/predict/batch-{batch}/shard-{shard}.log",
            benchmark:
                f"benchmarks/predict/batch-{batch}/shard-{shard}.tsv"
            conda:
                "../envs/environment.yaml"
            threads: rank_threads(PREDICT)
            resources:
                **ddp_resources(PREDICT),
            params:
                entry=entry_point("predict"),
                launcher=launcher(PREDICT),
                config=predict_job_config(),
                shards=predict_shards(),
                shard=shard,
                log_dir=f"logs/predict/batch-{batch}/shard-{shard}",
            shell:
                "{params.launcher}{params.entry} --job {input.job} --checkpoint {input.checkpoint}"
                " --config {params.config:q} --log-dir {params.log_dir} --shards {params.shards}"
                " --shard {params.shard} > {log} 2>&1"
