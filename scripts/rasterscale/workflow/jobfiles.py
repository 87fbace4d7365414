"""The job files of a plan (:mod:`rasterscale.jobs.files`), each built by its step
(:mod:`rasterscale.workflow.steps`). The main Snakemake process writes them all when it has built the plan
(:func:`write_job_files`), before the DAG: each is an input of its job's rule, rewritten only when its content
changes, so that a job reruns exactly when what it uses changed (and a job's re-parse writes nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from rasterscale.jobs.files import JobFile
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.steps import Steps


def job_files(plan: Plan) -> dict[str, JobFile]:
    """Every job file of the plan by its path."""
    return dict(Steps(plan).job_files())


def write_job_files(plan: Plan, workdir: str | Path = ".") -> int:
    """Write the plan's job files whose content changed (or that are missing); how many were written."""
    return sum(written for _, written in write_each_job_file(plan, workdir))


def write_each_job_file(plan: Plan, workdir: str | Path = ".") -> Iterator[tuple[str, bool]]:
    """Write each of the plan's job files whose content changed (or that is missing), one at a time: its path and
    whether it was written."""
    base = Path(workdir)
    for path, job in Steps(plan).job_files():
        yield path, job.write(base / path)
