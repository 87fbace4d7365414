# The predict step (rasterscale.workflow.steps.predict): one job per (batch, shard), on one node with world_size
# ranks: it loads the model once and predicts every scene of the batch; rank r of shard s writes
# {scene}/rank-{s * world_size + r}.* and its record {scene}/rank-{i}.json (rasterscale/jobs/rankfiles.py) into the
# shard's folder, for each scene of the batch. Its ranks save finished tiles in the sibling folder
# shard-{shard}.resume/ (kept when the job fails, removed when it succeeds): a rerun predicts only the rest
# (rasterscale/jobs/resume.py). Its job file (rasterscale.jobs.files.PredictJob) holds the batch's scenes, the model
# file, the shards and the task, model, tiling and predict sections.
rule predict:
    input:
        **STEPS.predict.inputs(),
    output:
        directory(STEPS.predict.output()),
    log:
        STEPS.predict.log("batch-{batch}/shard-{shard}"),
    benchmark:
        STEPS.predict.benchmark("batch-{batch}/shard-{shard}")
    wildcard_constraints:
        batch=r"\d+",
        shard=r"\d+",
    conda:
        "../envs/environment.yaml"
    threads: STEPS.predict.threads()
    resources:
        **STEPS.predict.resources(),
    params:
        entry=entry_point(STEPS.predict),
        launcher=launcher(STEPS.predict),
        log_dir=STEPS.predict.log_dir("batch-{batch}/shard-{shard}"),
        resume_dir=STEPS.predict.resume_dir,
    shell:
        "{params.launcher}{params.entry} --job {input.job:q} --shard {wildcards.shard} --out-dir {output:q}"
        " --log-dir {params.log_dir:q} --resume-dir {params.resume_dir:q} > {log:q} 2>&1"
