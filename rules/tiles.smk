rule tile_manifest:
    input:
        raster=lambda wildcards: scene_raster(wildcards.scene),
    output:
        "results/{scene}/tiles.parquet",
    log:
        "logs/tile_manifest/{scene}.log",
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("tile_manifest"),
        patch_size=CONFIG["tiling"]["patch_size"],
        overlap=CONFIG["tiling"]["overlap"],
        skip_nodata="--skip-nodata" if CONFIG["tiling"]["skip_nodata"] else "",
        imagery=lambda wildcards: scene_imagery(wildcards.scene),
    shell:
        "{params.entry} --raster {input.raster} --out {output}"
        " --patch-size {params.patch_size} --overlap {params.overlap} {params.skip_nodata}"
        " --imagery {params.imagery:q} > {log} 2>&1"
