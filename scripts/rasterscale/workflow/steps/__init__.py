"""The workflow's steps, one module each: what a step's rules declare and its jobs' files hold, under the step's one
name (:mod:`~rasterscale.workflow.steps.base`). The rules (``rules/*.smk``) read them through :class:`Steps`, one
object a step bound to the plan (``STEPS.merge.inputs(batch)``, ``STEPS.merge.resources(batch)``, ...); the plan
(:mod:`rasterscale.workflow.plan`) keeps the facts they are made of: scenes, batches, seams, footprints.

Adding a step is a module here (a :class:`~rasterscale.workflow.steps.base.Step` with its name, job file,
estimates, files and targets), a field of :class:`Steps`, a rule in ``rules/`` and its entry script in ``scripts/``
(docs/workflow.md, "Steps").
"""

from __future__ import annotations

from collections.abc import Iterator

from rasterscale.workflow.plan import Plan
from rasterscale.workflow.steps.base import JobFiles, Step
from rasterscale.workflow.steps.check import CheckEnvironment
from rasterscale.workflow.steps.cog import Cog
from rasterscale.workflow.steps.demo import Demo
from rasterscale.workflow.steps.merge import Merge
from rasterscale.workflow.steps.predict import Predict
from rasterscale.workflow.steps.project import Project
from rasterscale.workflow.steps.report import Report
from rasterscale.workflow.steps.score import Score
from rasterscale.workflow.steps.summary import Summary
from rasterscale.workflow.steps.tiles import Tiles
from rasterscale.workflow.steps.train import Train


class Steps:
    """Every step of a plan, in the order its data flows."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.demo = Demo(plan)
        self.cog = Cog(plan)
        self.tiles = Tiles(plan)
        self.train = Train(plan)
        self.predict = Predict(plan)
        self.merge = Merge(plan)
        self.score = Score(plan)
        self.project = Project(plan)
        self.summary = Summary(plan)
        self.report = Report(plan)
        self.check_environment = CheckEnvironment(plan)

    def __iter__(self) -> Iterator[Step]:
        return iter(
            (
                self.demo,
                self.cog,
                self.tiles,
                self.train,
                self.predict,
                self.merge,
                self.score,
                self.project,
                self.summary,
                self.report,
                self.check_environment,
            )
        )

    def final_targets(self) -> list[str]:
        """Rule all's input: every step's targets (:meth:`~rasterscale.workflow.steps.base.Step.targets`), those of
        the steps the data flows through first first."""
        return [target for step in self for target in step.targets()]

    def job_files(self) -> JobFiles:
        """Every job file of the plan with its path, one at a time (a batch's files hold its scenes' entries: at
        200,000 scenes, all of them at once would be gigabytes). A batch's tiles, predict and merge files come
        together: the plan keeps the entries of the last few batches only (Plan.prediction_batch)."""
        yield from self.check_environment.job_files()
        for number in self.plan.batch_numbers:
            yield self.tiles.job_file(number), self.tiles.job(number)
            yield self.predict.job_file(number), self.predict.job(number)
            yield self.merge.job_file(number), self.merge.job(number)
        yield from self.score.job_files()
        yield from self.tiles.job_files()  # the scenes no batch holds
        yield from self.train.job_files()
        yield from self.project.job_files()
        yield from self.summary.job_files()
        yield from self.demo.job_files()
        yield from self.report.job_files()
