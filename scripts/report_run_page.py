"""Entry (rule report_run_page, a Snakemake ``script:``): the report's page of the run (config, model, precision,
launch geometry) from its job file, the model file's training record and the scenes' prediction profiles."""

from pathlib import Path

from rasterscale.errors import run_entry
from rasterscale.jobs.files import RunPageJob
from rasterscale.tasks.exported.card import is_exported
from rasterscale.tasks.modelfiles import training_meta
from rasterscale.tools.report import read_json, run_page, write_text

snakemake = globals()["snakemake"]  # set by Snakemake's script preamble


def main() -> None:
    job = RunPageJob.read(snakemake.input.job)
    # an exported file (ONNX, torch.export, TorchScript) records no training: not read (torch would load it)
    trained = bool(job.model_file) and not is_exported(job.model_file, job.settings.model)
    meta = training_meta(job.model_file) if trained else None
    profiles = {name: read_json(path) for name, path in job.profiles.items()}
    write_text(run_page(job, meta, profiles), snakemake.output[0])
    Path(snakemake.log[0]).write_text(f"{snakemake.output[0]}: {len(profiles)} scene profile(s)\n")


run_entry(main)
