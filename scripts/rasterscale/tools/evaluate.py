"""The evaluation step (rules ``score_batch_{b}``, ``scripts/score_batch.py``): each predicted scene of a batch
scored by its task against its annotations (``evaluation.json`` and its quicklook:
:attr:`~rasterscale.tasks.spec.TaskSpec.evaluate`, the task's ``metrics`` module), or drawn without them (its
quicklook: :attr:`~rasterscale.tasks.spec.TaskSpec.quicklook`), then its pages for the report
(:func:`rasterscale.tools.report.render_scene`). Which scenes a batch scores and where their files go is the plan's
(:mod:`rasterscale.workflow.reportfiles`, :mod:`rasterscale.jobs.paths`)."""

from __future__ import annotations

from rasterscale.tools.report import render_scene
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.reportfiles import scene_files, scene_report, scored_scenes


def score_scene(plan: Plan, name: str) -> str:
    """Score a predicted scene: with annotations its evaluation and quicklook, without them its quicklook alone;
    a line for the log."""
    spec = plan.task
    job = plan.evaluation_job(name)
    scene = job.scene.as_mapping()
    if plan.is_evaluated(name):
        out, look = plan.paths.evaluation_file(name), plan.paths.quicklook_file(name)
        metrics = spec.evaluate(scene, job.config(), list(job.labels), out, look)
        return f"{name}: {spec.summarize(metrics)}"
    spec.quicklook(scene, job.config(), plan.paths.quicklook_file(name), name)
    return f"{name}: {plan.paths.quicklook_file(name)} (no annotations)"


def score_batch(plan: Plan, batch: int) -> list[str]:
    """Score and render each predicted scene of a batch (:func:`rasterscale.workflow.reportfiles.scored_scenes`):
    :func:`score_scene`, then its report pages. A line each for the log."""
    lines = []
    for name in scored_scenes(plan, batch):
        lines.append(score_scene(plan, name))
        counts = render_scene(scene_report(plan, name), plan.task, scene_files(plan, name))
        lines.append(f"{name}: {counts}")
    return lines
