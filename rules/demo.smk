rule synthesize_scene:
    output:
        raster=f"{DEMO['directory']}/{{name}}.tif",
        boxes=f"{DEMO['directory']}/{{name}}.gpkg",
        crowns=f"{DEMO['directory']}/{{name}}.crowns.gpkg",
        height=f"{DEMO['directory']}/{{name}}.height.tif",
        tops=f"{DEMO['directory']}/{{name}}.tops.gpkg",
    log:
        "logs/synthesize_scene/{name}.log",
    benchmark:
        "benchmarks/synthesize_scene/{name}.tsv"
    wildcard_constraints:
        name="|".join(DEMO["scenes"]) or "^$",
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=scene_mem_mb("synthesis", "name"),
    params:
        entry=entry_point("synthesize_scene"),
        width=lambda wildcards: DEMO["scenes"][wildcards.name]["width"],
        height=lambda wildcards: DEMO["scenes"][wildcards.name]["height"],
        seed=lambda wildcards: DEMO["scenes"][wildcards.name]["seed"],
        nir=lambda wildcards: "--nir" if DEMO["scenes"][wildcards.name]["nir"] else "",
        crs=DEMO["crs"],
        pixel_size=DEMO["pixel_size"],
    shell:
        "{params.entry} --raster {output.raster:q} --boxes {output.boxes:q} --crowns {output.crowns:q}"
        " --canopy-height {output.height:q} --tops {output.tops:q} {params.nir}"
        " --width {params.width} --height {params.height} --seed {params.seed}"
        " --crs {params.crs:q} --pixel-size {params.pixel_size} > {log:q} 2>&1"
