# A striped (untiled) input raster is read from a tiled COG made once from it (the plan's scene_raster).
rule convert_to_cog:
    input:
        scene_input("scene_source"),
    output:
        paths.cog_raster("{scene}"),
    log:
        "logs/convert_to_cog/{scene}.log",
    benchmark:
        "benchmarks/convert_to_cog/{scene}.tsv"
    wildcard_constraints:
        scene=pattern(sorted(PLAN.untiled)),
    conda:
        "../envs/environment.yaml"
    threads: 4
    params:
        entry=entry_point("convert_to_cog"),
    shell:
        "{params.entry} --src {input:q} --dst {output:q} --threads {threads} > {log:q} 2>&1"
