"""The score step: one job a batch (rule ``score_batch_{b}``), in one process: each predicted scene scored against
its annotations (evaluation.json) with its quicklook (without annotations: the quicklook alone), and its pages for
the report (:mod:`rasterscale.workflow.steps.report`). One job a scene would cost a DAG node and a Python start
each: 30,000 of them for 10,000 scenes."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from rasterscale.jobs.files import MergeJob, ScoredScene, ScoreJob
from rasterscale.raster.remote import local_files
from rasterscale.workflow import resources
from rasterscale.workflow.batches import EVERY_FILE, REPORTED_SCENES, missing_files, recorded_targets
from rasterscale.workflow.steps.base import BatchStep, JobFiles, RuleFunction
from rasterscale.workflow.steps.report import scene_pages


@dataclass(frozen=True)
class ScoredFile:
    """A file a batch's scoring job writes for a scene: shown in the report under the scene's name with
    ``caption`` (report/{caption}.rst) as ``item``, or not shown (``caption`` empty)."""

    path: str
    scene: str
    caption: str = ""
    item: str = ""


class Score(BatchStep):
    name = ScoreJob.KIND

    def scenes(self, batch: int) -> list[str]:
        """The scenes of a batch that its job scores and renders: the predicted ones (not its seams, nor a scene
        the config no longer names)."""
        return [name for name in self.plan.members[batch] if self.plan.is_predicted(name)]

    def batches(self) -> list[int]:
        """The batches with scenes to score and render."""
        return self.plan.batches_of(self.plan.predict_scenes)

    def inputs(self, batch: int) -> list[str]:
        """The batch's merge record (the scenes' merged outputs; their rasters come before them) and its scenes'
        annotations and true tree tops (the job file is the rule's own input)."""
        plan = self.plan
        evaluated = [name for name in self.scenes(batch) if plan.is_evaluated(name)]
        truth = [plan.scene_annotations(name) for name in evaluated]
        truth += local_files(plan.scene_tree_tops(name) for name in evaluated if plan.scene_tree_tops(name))
        return [plan.paths.batch_record(MergeJob.KIND, batch), *truth]

    def files(self, batch: int) -> list[ScoredFile]:
        """A batch's job's files besides its record: per scene its evaluation (with annotations), its quicklook
        and its renderings (scores and profile pages, the profile's plot, the counts)."""
        files = []
        for name in self.scenes(batch):
            pages = scene_pages(self.plan, name)
            quicklook = self.plan.paths.quicklook_file(name)
            if self.plan.is_evaluated(name):
                files.append(ScoredFile(self.plan.paths.evaluation_file(name), name))
                files.append(ScoredFile(quicklook, name, "quicklook", "quicklook"))
            else:
                files.append(ScoredFile(quicklook, name, "quicklook_unscored", "quicklook"))
            files += [
                ScoredFile(pages["scores"], name, "scores", "scores"),
                ScoredFile(pages["profile"], name, "profile", "prediction profile"),
                ScoredFile(pages["plot"], name, "profile_plot", "prediction profile (plot)"),
                ScoredFile(pages["counts"], name),
            ]
        return files

    def declared_files(self, batch: int, requested: AbstractSet[str]) -> list[ScoredFile]:
        """The files a batch's rule declares besides its record: every one while the run predicts at most
        :data:`~rasterscale.workflow.batches.REPORTED_SCENES` scenes (the report shows each scene's pages); beyond,
        as the other batch rules (:meth:`~rasterscale.workflow.steps.base.RecordedStep.declared_files`), those gone
        since the job ran and those ``requested`` (named on the command line), and the report shows the run and the
        project, not every scene. With :data:`~rasterscale.workflow.batches.EVERY_FILE`, every one (outputs on
        Snakemake's default storage)."""
        scored = self.files(batch)
        if self.plan.predicted_count <= REPORTED_SCENES or requested is EVERY_FILE:
            return scored
        gone = set(missing_files(self.record(batch), [f.path for f in scored]))
        return [f for f in scored if f.path in gone or f.path in requested]

    def mem_mb(self, batch: int) -> int:
        """One scene at a time: the largest scene's merged objects and as many annotations (a dense task's rasters
        are scored block by block), its quicklook and report pages."""
        plan = self.plan
        if resources.is_dense(plan):
            return resources.job_mb(resources.QUICKLOOK_MB * resources.MB)
        sizes = (resources.scene_size(plan, name) for name in plan.members[batch])
        held = max((2 * resources.objects_bytes(plan, size) for size in sizes), default=0)
        return resources.job_mb(held + resources.QUICKLOOK_MB * resources.MB)

    def resources(self, batch: int) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb(batch))

    def job(self, batch: int) -> ScoreJob:
        plan = self.plan
        scenes = []
        for name in self.scenes(batch):
            scene = plan.truth_scene(name, outputs=plan.scene_outputs(name))
            evaluation = plan.paths.evaluation_file(name) if plan.is_evaluated(name) else ""
            scenes.append(ScoredScene(scene, evaluation, plan.paths.quicklook_file(name), scene_pages(plan, name)))
        return ScoreJob(batch, tuple(scenes), plan.labels, self.carrying("task", "evaluate"))

    def job_files(self) -> JobFiles:
        for number in self.batches():
            yield self.job_file(number), self.job(number)

    def targets(self) -> list[str]:
        """Each predicted scene's evaluation, quicklook and renderings, by their batches' records
        (:func:`rasterscale.workflow.batches.recorded_targets`)."""
        return recorded_targets({self.record(b): [f.path for f in self.files(b)] for b in self.batches()})
