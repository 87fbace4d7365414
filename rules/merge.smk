# One merge job per batch of scenes (common.smk: BATCHES): each scene's rank files into its layers, in one process
# (a merge job's start-up, its imports, costs about what merging a small scene does). It checks from the rank
# records that every tile of each scene was processed exactly once before it reads any output.
for batch, names in enumerate(BATCHES):

    rule:
        name:
            f"merge_batch_{batch}"
        input:
            **batch_inputs(batch),
            job=batch_file(batch),
            shards=[shard_dir(batch, shard) for shard in range(predict_shards())],
        output:
            [path for name in names for path in scene_outputs(name).values()],
        log:
            f"logs/merge/batch-{batch}.log",
        benchmark:
            f"benchmarks/merge/batch-{batch}.tsv"
        conda:
            "../envs/environment.yaml"
        params:
            entry=entry_point("merge"),
            config=merge_job_config(),
        shell:
            "{params.entry} --job {input.job:q} --config {params.config:q} > {log:q} 2>&1"
