# The merge step (rasterscale.workflow.steps.merge): one job per batch of scenes, each scene's rank files into its
# layers, in one process. It checks from the rank records that every tile of each scene was processed exactly once
# before it reads any output. Its inputs are the batch's job file (rasterscale.jobs.files.MergeJob: its scenes, the
# class names, the task, merge and predict sections) and shard folders: the rasters and manifests it reads are the
# prediction's inputs, upstream. Its record comes first among its outputs and stands for the batch's layers: only
# those gone since the job ran are declared, and remade (at 10,000 scenes, declaring them all cost the DAG 6 s).
for batch in RULE_BATCHES:

    rule:
        name:
            STEPS.merge.rule(batch)
        input:
            **STEPS.merge.inputs(batch),
        output:
            **STEPS.merge.outputs(batch, REQUESTED),
        log:
            STEPS.merge.log(f"batch-{batch}"),
        benchmark:
            STEPS.merge.benchmark(f"batch-{batch}")
        conda:
            "../envs/environment.yaml"
        threads: STEPS.merge.threads()
        resources:
            **STEPS.merge.resources(batch),
        params:
            entry=entry_point(STEPS.merge),
        shell:
            "{params.entry} --job {input.job:q} --record {output.record:q} --threads {threads} > {log:q} 2>&1"
