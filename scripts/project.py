"""Entry: the project's layers from every predicted scene's and seam's merged layers (its job file lists them),
each object kept once across scene borders (rasterscale/grid/project.py)."""

import argparse

from rasterscale.errors import run_entry
from rasterscale.jobs.files import ProjectJob
from rasterscale.tasks.registry import task_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the project's job file (rasterscale.jobs.files.ProjectJob)")
    args = parser.parse_args()
    job = ProjectJob.read(args.job)
    spec = task_spec(job.settings.task)  # not the task itself: no torch here
    print(spec.merge_project(job))


if __name__ == "__main__":
    run_entry(main)
