# The score step (rasterscale.workflow.steps.score): per batch of scenes, in one process, each predicted scene
# scored against its annotations (evaluation.json) with its quicklook (without annotations: the quicklook alone),
# and its pages for the report (results/{run}/report/{scene}/).
for batch in RULE_BATCHES:

    rule:
        name:
            STEPS.score.rule(batch)
        input:
            STEPS.score.inputs(batch),
            job=STEPS.score.job_file(batch),
        output:
            record=STEPS.score.record(batch),  # first: rules/merge.smk
            files=scored_files(batch),
        log:
            STEPS.score.log(f"batch-{batch}"),
        benchmark:
            STEPS.score.benchmark(f"batch-{batch}")
        conda:
            "../envs/environment.yaml"
        resources:
            **STEPS.score.resources(batch),
        script:
            "../scripts/score.py"
