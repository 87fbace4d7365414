rule evaluate_scene:
    input:
        output=lambda wildcards: scene_outputs(wildcards.scene)[TASK.evaluated_output],
        raster=lambda wildcards: scene_raster(wildcards.scene),
        annotations=lambda wildcards: scene_annotations(wildcards.scene),
    output:
        evaluation="results/{scene}/evaluation.json",
        quicklook="results/{scene}/quicklook.png",
    log:
        "logs/evaluate_scene/{scene}.log",
    benchmark:
        "benchmarks/evaluate_scene/{scene}.tsv"
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("evaluate"),
        scene=lambda wildcards: evaluation_scene(wildcards.scene),
        config=config_json("task", "evaluate"),
        labels=labels_json(),
    shell:
        "{params.entry} --scene {params.scene:q} --config {params.config:q} --labels {params.labels:q}"
        " --out {output.evaluation:q} --quicklook {output.quicklook:q} > {log:q} 2>&1"
