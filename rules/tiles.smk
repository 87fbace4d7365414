# A scene's tile manifest. The scenes of predict.scenes get theirs from their batch's job (below, one process for
# the batch); this rule makes the others' (training-only scenes).
rule tile_manifest:
    input:
        raster=lambda wildcards: scene_raster(wildcards.scene),
    output:
        "results/{scene}/tiles.parquet",
    log:
        "logs/tile_manifest/{scene}.log",
    wildcard_constraints:
        scene=unbatched_scenes_pattern(),
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("tile_manifest"),
        patch_size=CONFIG["tiling"]["patch_size"],
        overlap=CONFIG["tiling"]["overlap"],
        skip_nodata="--skip-nodata" if CONFIG["tiling"]["skip_nodata"] else "",
        imagery=lambda wildcards: scene_imagery(wildcards.scene),
    shell:
        "{params.entry} --raster {input.raster:q} --out {output:q}"
        " --patch-size {params.patch_size} --overlap {params.overlap} {params.skip_nodata}"
        " --imagery {params.imagery:q} > {log:q} 2>&1"


for batch, names in enumerate(BATCHES):

    rule:
        name:
            f"tile_manifests_batch_{batch}"
        input:
            rasters=[scene_raster(name) for name in names],
            job=batch_file(batch),
        output:
            [scene_manifest(name) for name in names],
        log:
            f"logs/tile_manifest/batch-{batch}.log",
        benchmark:
            f"benchmarks/tile_manifest/batch-{batch}.tsv"
        conda:
            "../envs/environment.yaml"
        params:
            entry=entry_point("tile_manifest"),
            patch_size=CONFIG["tiling"]["patch_size"],
            overlap=CONFIG["tiling"]["overlap"],
            skip_nodata="--skip-nodata" if CONFIG["tiling"]["skip_nodata"] else "",
        shell:
            "{params.entry} --job {input.job:q}"
            " --patch-size {params.patch_size} --overlap {params.overlap} {params.skip_nodata} > {log:q} 2>&1"
