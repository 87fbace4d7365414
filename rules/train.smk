# The train step (rasterscale.workflow.steps.train): DDP over the job's ranks; its job file
# (rasterscale.jobs.files.TrainJob) holds the training scenes and the task, model, tiling and train sections with the
# training scenes' entries.
rule train:
    input:
        unpack(STEPS.train.start_inputs),
        **STEPS.train.inputs(),
    output:
        **training_outputs("{model}"),
    log:
        STEPS.train.log("{model}"),
    benchmark:
        STEPS.train.benchmark("{model}")
    conda:
        "../envs/environment.yaml"
    threads: STEPS.train.threads()
    resources:
        **STEPS.train.resources(),
    params:
        entry=entry_point(STEPS.train),
        launcher=launcher(STEPS.train),
        log_dir=STEPS.train.log_dir("{model}"),
    shell:
        "{params.launcher}{params.entry} --job {input.job:q}"
        " --model {output.model:q} --metrics {output.metrics:q} --plot {output.plot:q} --log-dir {params.log_dir:q}"
        " > {log:q} 2>&1"
