rule evaluate_scene:
    input:
        output=lambda wildcards: PLAN.scene_outputs(wildcards.scene)[TASK.evaluated_output],
        rasters=scene_input("raster_inputs"),
        annotations=scene_input("scene_annotations"),
    output:
        evaluation=paths.evaluation_file("{scene}"),
        quicklook=report_flag(paths.quicklook_file("{scene}"), "quicklook", reportfiles.SCENES, "quicklook", "{scene}"),
    log:
        "logs/evaluate_scene/{scene}.log",
    benchmark:
        "benchmarks/evaluate_scene/{scene}.tsv"
    wildcard_constraints:
        scene=pattern(PLAN.evaluated_scenes()),
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("evaluate"),
        job=lambda wildcards: PLAN.evaluation_job(wildcards.scene).to_json(),
    shell:
        "{params.entry} --job {params.job:q} --out {output.evaluation:q} --quicklook {output.quicklook:q}"
        " > {log:q} 2>&1"
