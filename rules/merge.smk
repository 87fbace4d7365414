# One merge job per batch of scenes (common.smk: BATCHES): each scene's rank files into one layer, in one
# process (a merge job's start-up, its imports, costs about what merging a small scene does).
for batch, names in enumerate(BATCHES):

    rule:
        name:
            f"merge_batch_{batch}"
        input:
            **batch_inputs(batch),
            job=batch_file(batch),
            ranks=[path for name in names for path in scene_rank_files(name)],
        output:
            [path for name in names for path in scene_detections(name).values()],
        log:
            f"logs/merge/batch-{batch}.log",
        benchmark:
            f"benchmarks/merge/batch-{batch}.tsv"
        conda:
            "../envs/environment.yaml"
        params:
            entry=entry_point("merge"),
            config=json.dumps(CONFIG["merge"]),
        shell:
            "{params.entry} --job {input.job} --config {params.config:q} > {log} 2>&1"
