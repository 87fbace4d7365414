# The report step (rasterscale.workflow.steps.report): what the Snakemake report (`snakemake --report report.zip`
# after a run, or `--report-after-run`) shows that the rest of the run does not write, rendered by small local jobs
# under results/{run}/report/ (rasterscale.tools.report draws them). Categories are numbered: the report orders them
# by name. Outputs are flagged with report_flag() (rules/common.smk), as train.smk and evaluate.smk flag theirs. The
# report jobs read their job files (rasterscale.jobs.files.RunPageJob, ProjectMapJob).
rule report_run_page:
    input:
        unpack(STEPS.report.run_inputs),
    output:
        report_flag(
            STEPS.report.run_page(),
            "run",
            report_step.RUN,
            "config, model, precision, launch geometry",
            "run",
        ),
    log:
        STEPS.report.log("run_page"),
    benchmark:
        STEPS.report.benchmark("run_page")
    localrule: True
    conda:
        "../envs/environment.yaml"
    resources:
        **STEPS.report.resources(),
    script:
        "../scripts/report_run_page.py"


rule report_project_map:
    input:
        unpack(STEPS.report.map_inputs),
    output:
        report_flag(
            STEPS.report.project_map(),
            "project_map",
            report_step.PROJECT,
            "summary raster, or scene footprints and counts",
            "map",
        ),
    log:
        STEPS.report.log("project_map"),
    benchmark:
        STEPS.report.benchmark("project_map")
    localrule: True
    conda:
        "../envs/environment.yaml"
    resources:
        **STEPS.report.resources(),
    script:
        "../scripts/report_project_map.py"
