"""Entry: score a scene's merged output against its annotations; write evaluation.json and a quicklook."""

import argparse

from rasterscale.errors import run_entry
from rasterscale.raster.remote import shown
from rasterscale.tasks.registry import task_spec
from rasterscale.workflow.jobfiles import EvaluationJob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--job", type=EvaluationJob.from_json, required=True, help="JSON: the scene, the task, evaluate, labels"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--quicklook", required=True)
    args = parser.parse_args()
    job: EvaluationJob = args.job
    spec = task_spec(job.task)
    metrics = spec.evaluate(job.scene.as_mapping(), job.config(), list(job.labels), args.out, args.quicklook)
    print(f"{shown(job.scene.raster)}: {spec.summarize(metrics)}")


if __name__ == "__main__":
    run_entry(main)
