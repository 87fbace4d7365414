# The demo step (rasterscale.workflow.steps.demo): a demo scene, synthesized as its job file
# (rasterscale.jobs.files.SynthesisJob, beside the demo's data) says.
rule demo:
    input:
        job=STEPS.demo.job_file("{name}"),
    output:
        **STEPS.demo.outputs(),
    log:
        STEPS.demo.log("{name}"),
    benchmark:
        STEPS.demo.benchmark("{name}")
    wildcard_constraints:
        name=pattern(STEPS.demo.scenes()),
    conda:
        "../envs/environment.yaml"
    resources:
        **STEPS.demo.resources(),
    params:
        entry=entry_point(STEPS.demo),
    shell:
        "{params.entry} --job {input.job:q} --raster {output.raster:q} --boxes {output.boxes:q}"
        " --crowns {output.crowns:q} --canopy-height {output.height:q} --tops {output.tops:q} > {log:q} 2>&1"
