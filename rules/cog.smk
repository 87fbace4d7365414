# A striped (untiled) input raster is read from a tiled COG made once from it (the plan's scene_raster), on cog.threads
# threads, within GDAL's block cache of its memory estimate (rasterscale.workflow.resources).
rule convert_to_cog:
    input:
        scene_input("scene_source"),
    output:
        PATHS.cog_raster("{scene}"),
    log:
        "logs/convert_to_cog/{scene}.log",
    benchmark:
        "benchmarks/convert_to_cog/{scene}.tsv"
    wildcard_constraints:
        scene=pattern(sorted(PLAN.untiled)),
    conda:
        "../envs/environment.yaml"
    threads: PLAN.settings.cog.threads
    resources:
        mem_mb=scene_mem_mb("cog"),
    params:
        entry=entry_point("convert_to_cog"),
        gdal_cache_mb=job_memory.COG_GDAL_CACHE_MB,  # the memory estimate's cache (rasterscale.workflow.resources)
    shell:
        "GDAL_CACHEMAX={params.gdal_cache_mb} {params.entry} --src {input:q} --dst {output:q}"
        " --threads {threads} > {log:q} 2>&1"
