rule evaluate_scene:
    input:
        detections="results/{scene}/detections.parquet",
        raster=lambda wildcards: scene_raster(wildcards.scene),
        annotations=lambda wildcards: scene_annotations(wildcards.scene),
    output:
        evaluation="results/{scene}/evaluation.json",
        quicklook="results/{scene}/quicklook.png",
    log:
        "logs/evaluate_scene/{scene}.log",
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("evaluate"),
        config=config_json("evaluate"),
        labels=labels_json(),
        label_column=lambda wildcards: SCENES[wildcards.scene].get("label_column", ""),
        image_path=lambda wildcards: scene_image_name(wildcards.scene),
    shell:
        "{params.entry} --detections {input.detections} --raster {input.raster}"
        " --annotations {input.annotations} --label-column '{params.label_column}' --config {params.config:q}"
        " --image-path {params.image_path:q} --labels {params.labels:q}"
        " --out {output.evaluation} --quicklook {output.quicklook} > {log} 2>&1"
