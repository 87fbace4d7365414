"""Entry: the quicklook of a predicted scene without annotations (no evaluation draws it): its merged output over
its imagery."""

import argparse

from rasterscale.errors import run_entry
from rasterscale.tasks.registry import task_spec
from rasterscale.workflow.jobfiles import EvaluationJob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", type=EvaluationJob.from_json, required=True, help="JSON: scene, task, evaluate")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    job: EvaluationJob = args.job
    task_spec(job.task).quicklook(job.scene.as_mapping(), job.config(), args.out, job.scene.name)
    print(f"{job.scene.raster}: {args.out}")


if __name__ == "__main__":
    run_entry(main)
