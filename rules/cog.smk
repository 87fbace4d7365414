# A striped (untiled) input raster is read from a tiled COG made once from it (common.smk: scene_raster).
rule convert_to_cog:
    input:
        lambda wildcards: scene_source(wildcards.scene),
    output:
        "results/{scene}/cog.tif",
    log:
        "logs/convert_to_cog/{scene}.log",
    benchmark:
        "benchmarks/convert_to_cog/{scene}.tsv"
    wildcard_constraints:
        scene="|".join(sorted(UNTILED)) or "^$",
    conda:
        "../envs/environment.yaml"
    threads: 4
    params:
        entry=entry_point("convert_to_cog"),
    shell:
        "{params.entry} --src {input:q} --dst {output:q} --threads {threads} > {log:q} 2>&1"
