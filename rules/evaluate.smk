# Per batch of scenes (the plan's batches), in one process: each predicted scene scored against its annotations
# (evaluation.json) with its quicklook (without annotations: the quicklook alone), and its pages for the report
# (results/{run}/report/{scene}/). One job a scene would cost a DAG node and a Python start each: 30,000 of them for
# 10,000 scenes.
for batch in RULE_BATCHES:

    rule:
        name:
            batches.batch_rule("score", batch)
        input:
            reportfiles.score_inputs(PLAN, batch),
            job=PATHS.job_file("score", batch),
        output:
            **scored_outputs(batch),
        log:
            f"logs/score/batch-{batch}.log",
        benchmark:
            f"benchmarks/score/batch-{batch}.tsv"
        conda:
            "../envs/environment.yaml"
        resources:
            mem_mb=mem_mb("score", batch),
        script:
            "../scripts/score_batch.py"
