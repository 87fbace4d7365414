rule merge_detections:
    input:
        raster=lambda wildcards: scene_raster(wildcards.scene),
        manifest="results/{scene}/tiles.parquet",
        ranks=rank_files,
    output:
        gpkg="results/{scene}/detections.gpkg",
        parquet="results/{scene}/detections.parquet",
        profile="results/{scene}/predict_profile.json",
    log:
        "logs/merge_detections/{scene}.log",
    benchmark:
        "benchmarks/merge_detections/{scene}.tsv"
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("merge"),
        config=json.dumps(CONFIG["merge"]),
    shell:
        "{params.entry} --manifest {input.manifest} --raster {input.raster}"
        " --gpkg {output.gpkg} --parquet {output.parquet} --profile {output.profile} --config {params.config:q}"
        " {input.ranks} > {log} 2>&1"
