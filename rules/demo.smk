rule synthesize_scene:
    output:
        raster=f"{DEMO['directory']}/{{name}}.tif",
        boxes=f"{DEMO['directory']}/{{name}}.gpkg",
    params:
        width=lambda wildcards: DEMO["scenes"][wildcards.name]["width"],
        height=lambda wildcards: DEMO["scenes"][wildcards.name]["height"],
        seed=lambda wildcards: DEMO["scenes"][wildcards.name]["seed"],
        crs=DEMO["crs"],
        pixel_size=DEMO["pixel_size"],
    wildcard_constraints:
        name="|".join(DEMO["scenes"]) or "^$",
    log:
        "logs/synthesize_scene/{name}.log",
    benchmark:
        "benchmarks/synthesize_scene/{name}.tsv"
    shell:
        "{PYTHON} {SCRIPTS}/synthesize_scene.py --raster {output.raster} --boxes {output.boxes}"
        " --width {params.width} --height {params.height} --seed {params.seed}"
        " --crs {params.crs} --pixel-size {params.pixel_size} > {log} 2>&1"
