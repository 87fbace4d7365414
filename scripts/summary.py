"""Entry: the project's summary raster (rasterscale/raster/summary.py): objects per hectare, class cover or mean
value a coarse cell, from the project's layer (its partitions, its GeoParquet file or its mosaic)."""

import argparse

from rasterscale.errors import run_entry
from rasterscale.grid.partitions import remove_stale
from rasterscale.jobs.files import SummaryJob
from rasterscale.raster.summary import summarize_layer
from rasterscale.tasks.registry import task_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the summary's job file (rasterscale.jobs.files.SummaryJob)")
    args = parser.parse_args()
    job = SummaryJob.read(args.job)
    kind = task_spec(job.settings.task).project_summary
    if kind == "objects" and all("/batch-" in layer for layer in job.layers):
        for stale in remove_stale(job.layers):
            print(f"removed {stale}: its batch holds no project source")
    cell = job.settings.project.summary_cell
    print(summarize_layer(kind, job.layers, cell, job.crs, job.labels, job.output))


if __name__ == "__main__":
    run_entry(main)
