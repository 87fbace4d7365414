# One prediction job per (batch, shard), on one node with world_size ranks: it loads the model once and predicts
# every scene of the batch; rank r of shard s writes {scene}/rank-{s * world_size + r}.* and its record
# {scene}/rank-{i}.json (rasterscale/jobs/rankfiles.py) into the shard's folder, for each scene of the batch. Its
# ranks save finished tiles in the sibling folder shard-{shard}.resume/ (kept when the job fails, removed when
# it succeeds): a rerun predicts only the rest (rasterscale/jobs/resume.py).
# Its job file (rasterscale.jobs.files.PredictJob) holds the batch's scenes, the model file, the shards and the task,
# model, tiling and predict sections. Its inputs are the record of the batch's tile manifests (the manifests and
# seams' mosaics that job wrote; the rasters come before them): every input file costs the DAG a producer lookup
# (rasterscale/workflow/batches.py).
rule predict:
    input:
        tiled=PATHS.batch_record("tiled", "{batch}"),
        job=PATHS.job_file("predict", "{batch}"),
        model=PLAN.prediction_model(),
    output:
        directory(PATHS.shard_dir("{batch}", "{shard}")),
    log:
        "logs/predict/batch-{batch}/shard-{shard}.log",
    benchmark:
        "benchmarks/predict/batch-{batch}/shard-{shard}.tsv"
    wildcard_constraints:
        batch=r"\d+",
        shard=r"\d+",
    conda:
        "../envs/environment.yaml"
    threads: PLAN.rank_threads("predict")
    resources:
        **ddp_resources("predict"),
    params:
        entry=entry_point("predict"),
        launcher=launcher("predict"),
        log_dir="logs/predict/batch-{batch}/shard-{shard}",
        resume_dir=lambda wildcards: PATHS.shard_resume_dir(wildcards.batch, wildcards.shard),
    shell:
        "{params.launcher}{params.entry} --job {input.job:q} --shard {wildcards.shard} --out-dir {output:q}"
        " --log-dir {params.log_dir:q} --resume-dir {params.resume_dir:q} > {log:q} 2>&1"
