# The Snakemake report (`snakemake --report report.zip` after a run, or `--report-after-run`): what it shows that the
# rest of the run does not write, rendered by small local jobs under results/{run}/report/
# (rasterscale.workflow.reportfiles says which file is which, rasterscale.tools.report draws them). Categories are
# numbered: the report orders them by name. Outputs are flagged with report_flag() (rules/common.smk), as train.smk
# and evaluate.smk flag theirs. The report jobs read their job files (rasterscale.jobs.files.RunPageJob,
# ProjectMapJob).
rule report_run:
    input:
        unpack(lambda wildcards: reportfiles.run_inputs(PLAN)),
        job=PATHS.job_file("run_page"),
    output:
        report_flag(
            PATHS.report_file(reportfiles.RUN_PAGE),
            "run",
            reportfiles.RUN,
            "config, model, precision, launch geometry",
            "run",
        ),
    log:
        "logs/report/run.log",
    benchmark:
        "benchmarks/report/run.tsv"
    localrule: True
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=mem_mb("report"),
    script:
        "../scripts/report_run.py"


rule report_project_map:
    input:
        unpack(lambda wildcards: reportfiles.project_inputs(PLAN)),
        job=PATHS.job_file("project_map"),
    output:
        report_flag(
            PATHS.report_file(reportfiles.PROJECT_MAP),
            "project_map",
            reportfiles.PROJECT,
            "summary raster, or scene footprints and counts",
            "map",
        ),
    log:
        "logs/report/project_map.log",
    benchmark:
        "benchmarks/report/project_map.tsv"
    localrule: True
    conda:
        "../envs/environment.yaml"
    resources:
        mem_mb=mem_mb("report"),
    script:
        "../scripts/report_project_map.py"
