# A demo scene, synthesized as its job file (rasterscale.jobs.files.SynthesisJob, beside the demo's data) says.
rule synthesize_scene:
    input:
        job=paths.synthesis_job(DEMO.directory, "{name}"),
    output:
        raster=f"{DEMO.directory}/{{name}}.tif",
        boxes=f"{DEMO.directory}/{{name}}.gpkg",
        crowns=f"{DEMO.directory}/{{name}}.crowns.gpkg",
        height=f"{DEMO.directory}/{{name}}.height.tif",
        tops=f"{DEMO.directory}/{{name}}.tops.gpkg",
    log:
        "logs/synthesize_scene/{name}.log",
    benchmark:
        "benchmarks/synthesize_scene/{name}.tsv"
    wildcard_constraints:
        name=pattern(jobfiles.demo_scenes(PLAN)),
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=scene_mem_mb("synthesis", "name"),
    params:
        entry=entry_point("synthesize_scene"),
    shell:
        "{params.entry} --job {input.job:q} --raster {output.raster:q} --boxes {output.boxes:q}"
        " --crowns {output.crowns:q} --canopy-height {output.height:q} --tops {output.tops:q} > {log:q} 2>&1"
