# A scene's tile manifest. The scenes of predict.scenes get theirs from their batch's job (below, one process for
# the batch); this rule makes the others' (training-only scenes). A remote raster (a URL) is no input file: the
# job reads it by its URL (params.raster).
rule tile_manifest:
    input:
        scene_input("raster_inputs"),
    output:
        PATHS.scene_manifest("{scene}"),
    log:
        "logs/tile_manifest/{scene}.log",
    wildcard_constraints:
        scene=pattern(PLAN.unbatched_scenes()),
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=scene_mem_mb("tile_manifest"),
    params:
        entry=entry_point("tile_manifest"),
        raster=scene_input("scene_raster"),
        patch_size=CONFIG["tiling"]["patch_size"],
        overlap=CONFIG["tiling"]["overlap"],
        skip_nodata="--skip-nodata" if CONFIG["tiling"]["skip_nodata"] else "",
        imagery=lambda wildcards: json.dumps(PLAN.scene_imagery(wildcards.scene).to_dict(), separators=(",", ":")),
    shell:
        "{params.entry} --raster {params.raster:q} --out {output:q}"
        " --patch-size {params.patch_size} --overlap {params.overlap} {params.skip_nodata}"
        " --imagery {params.imagery:q} > {log:q} 2>&1"


# A seam's manifest comes with the mosaic of its scenes' rasters it is cut from.
for batch in RULE_BATCHES:

    rule:
        name:
            batches.batch_rule("tile_manifests", batch)
        input:
            rasters=PLAN.batch_inputs(batch)["rasters"],
            job=PATHS.batch_file(batch),
        output:
            record=PATHS.batch_record("tiled", batch),
            files=PLAN.batch_files("tiled", batch),
        log:
            f"logs/tile_manifest/batch-{batch}.log",
        benchmark:
            f"benchmarks/tile_manifest/batch-{batch}.tsv"
        conda:
            "../envs/environment.yaml"
        resources:
            mem_mb=mem_mb("batch_tile_manifest", batch),
        params:
            entry=entry_point("tile_manifest"),
            patch_size=CONFIG["tiling"]["patch_size"],
            overlap=CONFIG["tiling"]["overlap"],
            skip_nodata="--skip-nodata" if CONFIG["tiling"]["skip_nodata"] else "",
        shell:
            "{params.entry} --job {input.job:q} --record {output.record:q}"
            " --patch-size {params.patch_size} --overlap {params.overlap} {params.skip_nodata} > {log:q} 2>&1"
