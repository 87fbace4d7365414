# One merge job per batch of scenes (the plan's batches): each scene's rank files into its layers, in one process
# (a merge job's start-up, its imports, costs about what merging a small scene does). It checks from the rank
# records that every tile of each scene was processed exactly once before it reads any output. Its inputs are the
# batch's job file (rasterscale.jobs.files.MergeJob: its scenes, the class names, the task, merge and predict sections) and
# shard folders: the rasters and manifests it reads are the prediction's inputs, upstream.
# Its record comes first among its outputs: Snakemake finds the producer of a file by trying the rule's outputs in
# order, and what reads the batch asks for the record (at 10,000 scenes, last it cost the DAG about 6 s).
# It stands for the batch's layers: only those gone since the job ran are declared (PLAN.declared_files), and remade.
# A dense task's merge writes COG layers, on cog.threads cores (PLAN.merge_threads: a segmentation's classes,
# probabilities and polygons side by side, rasterscale.tasks.merging.finish_layers); the others' take one.
for batch in RULE_BATCHES:

    rule:
        name:
            batches.batch_rule("merge", batch)
        input:
            job=PATHS.job_file("merge", batch),
            shards=[PATHS.shard_dir(batch, shard) for shard in range(PLAN.shards)],
        output:
            record=PATHS.batch_record("merged", batch),
            files=PLAN.declared_files("merged", batch, REQUESTED),
        log:
            f"logs/merge/batch-{batch}.log",
        benchmark:
            f"benchmarks/merge/batch-{batch}.tsv"
        conda:
            "../envs/environment.yaml"
        threads: PLAN.merge_threads()
        resources:
            mem_mb=mem_mb("merge", batch),
        params:
            entry=entry_point("merge"),
        shell:
            "{params.entry} --job {input.job:q} --record {output.record:q} --threads {threads} > {log:q} 2>&1"
