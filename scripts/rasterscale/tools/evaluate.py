"""The evaluation step (rules ``score_batch_{b}``, ``scripts/score.py``): each predicted scene of a batch's
scoring job file scored by its task against its annotations (``evaluation.json`` and its quicklook:
:attr:`~rasterscale.tasks.spec.TaskSpec.evaluate`, the task's ``metrics`` module), or drawn without them (its
quicklook: :attr:`~rasterscale.tasks.spec.TaskSpec.quicklook`), then its pages for the report
(:func:`rasterscale.tools.report.render_scene`). Which scenes a batch scores and where their files go is the plan's
(:meth:`rasterscale.workflow.steps.score.Score.job`)."""

from __future__ import annotations

from rasterscale.jobs.files import ScoredScene, ScoreJob
from rasterscale.tasks.registry import task_spec
from rasterscale.tasks.spec import TaskSpec
from rasterscale.tools.report import render_scene


def score_scene(scored: ScoredScene, job: ScoreJob, task_spec: TaskSpec) -> str:
    """Score a predicted scene: with annotations its evaluation and quicklook, without them its quicklook alone;
    a line for the log."""
    scene, name = scored.scene, scored.scene.name
    if scored.evaluation:
        metrics = task_spec.evaluate(scene, job.settings, list(job.labels), scored.evaluation, scored.quicklook)
        return f"{name}: {task_spec.summarize(metrics)}"
    task_spec.quicklook(scene, job.settings, scored.quicklook, name)
    return f"{name}: {scored.quicklook} (no annotations)"


def score_batch(job: ScoreJob) -> list[str]:
    """Score and render each scene of a batch's scoring job: :func:`score_scene`, then its report pages. A line
    each for the log."""
    spec = task_spec(job.settings.task)
    lines = []
    for scored in job.scenes:
        lines.append(score_scene(scored, job, spec))
        counts = render_scene(scored, job.labels, spec)
        lines.append(f"{scored.scene.name}: {counts}")
    return lines
