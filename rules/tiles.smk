# The tiles step (rasterscale.workflow.steps.tiles): a scene's tile manifest. The scenes of predict.scenes get theirs
# from their batch's job (below, one process for the batch); this rule makes the others' (training-only scenes). Each
# job reads its job file (the plan's, written before the DAG: rasterscale.workflow.jobfiles): its scenes' rasters,
# manifests, imagery keys and the tiling section. A remote raster (a URL) is no input file: the job reads it by its
# URL from its job file.
rule tiles:
    input:
        raster=STEPS.tiles.scene_rasters,
        job=STEPS.tiles.scene_job_file("{scene}"),
    output:
        PATHS.scene_manifest("{scene}"),
    log:
        STEPS.tiles.log("{scene}"),
    wildcard_constraints:
        scene=pattern(PLAN.unbatched_scenes()),
    conda:
        "../envs/environment.yaml"
    resources:
        **STEPS.tiles.scene_resources(),
    params:
        entry=entry_point(STEPS.tiles),
    shell:
        "{params.entry} --job {input.job:q} > {log:q} 2>&1"


# A seam's manifest comes with the mosaic of its scenes' rasters it is cut from. The job's record stands for its
# manifests and mosaics (only those gone since it ran are declared, and remade: RecordedStep.declared_files).
for batch in RULE_BATCHES:

    rule:
        name:
            STEPS.tiles.rule(batch)
        input:
            **STEPS.tiles.inputs(batch),
        output:
            **STEPS.tiles.outputs(batch, REQUESTED),
        log:
            STEPS.tiles.log(f"batch-{batch}"),
        benchmark:
            STEPS.tiles.benchmark(f"batch-{batch}")
        conda:
            "../envs/environment.yaml"
        resources:
            **STEPS.tiles.resources(batch),
        params:
            entry=entry_point(STEPS.tiles),
        shell:
            "{params.entry} --job {input.job:q} --record {output.record:q} > {log:q} 2>&1"
