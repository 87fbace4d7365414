# A scene's tile manifest. The scenes of predict.scenes get theirs from their batch's job (below, one process for
# the batch); this rule makes the others' (training-only scenes). Each job reads its job file (the plan's, written
# before the DAG: rasterscale.workflow.jobfiles): its scenes' rasters, manifests, imagery keys and the tiling
# section. A remote raster (a URL) is no input file: the job reads it by its URL from its job file.
rule tile_manifest:
    input:
        raster=scene_input("raster_inputs"),
        job=PATHS.scene_job("{scene}"),
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
    shell:
        "{params.entry} --job {input.job:q} > {log:q} 2>&1"


# A seam's manifest comes with the mosaic of its scenes' rasters it is cut from. The job's record stands for its
# manifests and mosaics (PLAN.declared_files: only those gone since it ran are declared, and remade).
for batch in RULE_BATCHES:

    rule:
        name:
            batches.batch_rule("tile_manifests", batch)
        input:
            rasters=PLAN.batch_inputs(batch)["rasters"],
            job=PATHS.job_file("tiles", batch),
        output:
            record=PATHS.batch_record("tiled", batch),
            files=PLAN.declared_files("tiled", batch, REQUESTED),
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
        shell:
            "{params.entry} --job {input.job:q} --record {output.record:q} > {log:q} 2>&1"
