# The cog step (rasterscale.workflow.steps.cog): a striped (untiled) input raster is read from a tiled COG made once
# from it (the plan's scene_raster), on cog.threads threads, within GDAL's block cache of its memory estimate.
rule cog:
    input:
        STEPS.cog.source,
    output:
        STEPS.cog.output(),
    log:
        STEPS.cog.log("{scene}"),
    benchmark:
        STEPS.cog.benchmark("{scene}")
    wildcard_constraints:
        scene=pattern(STEPS.cog.scenes()),
    conda:
        "../envs/environment.yaml"
    threads: STEPS.cog.threads()
    resources:
        **STEPS.cog.resources(),
    params:
        entry=entry_point(STEPS.cog),
        gdal_cache_mb=STEPS.cog.gdal_cache_mb,  # the memory estimate's cache
    shell:
        "GDAL_CACHEMAX={params.gdal_cache_mb} {params.entry} --src {input:q} --dst {output:q}"
        " --threads {threads} > {log:q} 2>&1"
