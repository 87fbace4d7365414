# The Snakemake report (`snakemake --report report.zip` after a run, or `--report-after-run`): what it shows that the
# rest of the run does not write, rendered by small local jobs under results/report/ (rasterscale.workflow.reportfiles
# says which file is which, rasterscale.tools.report draws them). Categories are numbered: the report orders them
# by name. Outputs are flagged with report_flag() (rules/common.smk), as train.smk and evaluate.smk flag theirs. The
# report jobs load the stored plan (their only param is its key): the report lists a job's params.
rule report_run:
    input:
        unpack(lambda wildcards: reportfiles.run_inputs(PLAN)),
    output:
        report_flag(
            paths.report_file(reportfiles.RUN_PAGE),
            "run",
            reportfiles.RUN,
            "config, model, precision, launch geometry",
            "run",
        ),
    log:
        "logs/report/run.log",
    localrule: True
    conda:
        "../envs/environment.yaml"
    params:
        config=PLAN_KEY,  # the page shows the whole config: redone when it changes
    script:
        "../scripts/report_run.py"


rule report_scene:
    input:
        unpack(lambda wildcards: reportfiles.scene_inputs(PLAN, wildcards.scene)),
    output:
        scores=report_flag(
            reportfiles.scene_files("{scene}")["scores"], "scores", reportfiles.SCENES, "scores", "{scene}"
        ),
        profile=report_flag(
            reportfiles.scene_files("{scene}")["profile"],
            "profile",
            reportfiles.SCENES,
            "prediction profile",
            "{scene}",
        ),
        plot=report_flag(
            reportfiles.scene_files("{scene}")["plot"],
            "profile_plot",
            reportfiles.SCENES,
            "prediction profile (plot)",
            "{scene}",
        ),
        counts=reportfiles.scene_files("{scene}")["counts"],
    log:
        "logs/report/{scene}.log",
    wildcard_constraints:
        scene=pattern(PLAN.predict_scenes),
    localrule: True
    conda:
        "../envs/environment.yaml"
    script:
        "../scripts/report_scene.py"


# The quicklook of a predicted scene without annotations (an evaluated scene's is drawn by its evaluation).
rule quicklook_scene:
    input:
        output=lambda wildcards: PLAN.scene_outputs(wildcards.scene)[TASK.evaluated_output],
        raster=scene_input("scene_raster"),
    output:
        report_flag(paths.quicklook_file("{scene}"), "quicklook_unscored", reportfiles.SCENES, "quicklook", "{scene}"),
    log:
        "logs/quicklook_scene/{scene}.log",
    wildcard_constraints:
        scene=pattern(reportfiles.unevaluated_scenes(PLAN)),
    conda:
        "../envs/environment.yaml"
    params:
        entry=entry_point("quicklook"),
        job=lambda wildcards: PLAN.evaluation_job(wildcards.scene).to_json(),
    shell:
        "{params.entry} --job {params.job:q} --out {output:q} > {log:q} 2>&1"


rule report_project_map:
    input:
        **reportfiles.project_inputs(PLAN),
    output:
        report_flag(
            paths.report_file(reportfiles.PROJECT_MAP),
            "project_map",
            reportfiles.PROJECT,
            "scene footprints and counts",
            "map",
        ),
    log:
        "logs/report/project_map.log",
    localrule: True
    conda:
        "../envs/environment.yaml"
    script:
        "../scripts/report_project_map.py"
