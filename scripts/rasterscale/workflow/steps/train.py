"""The train step: one job (rule ``train``) training the task's model with DDP over its ranks, on one node or many,
from the training scenes' rasters, annotations and tile manifests."""

from __future__ import annotations

from typing import Any

from rasterscale.jobs import paths
from rasterscale.jobs.files import TrainJob
from rasterscale.settings import SceneSettings
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.steps.base import JobFiles, RanksStep
from rasterscale.workflow.steps.tiles import Tiles


def training_entries(plan: Plan) -> dict[str, SceneSettings]:
    """The training scenes' entries of ``scenes`` (their bands and normalize make the model's input), not the
    others' (adding a scene to predict changes no training)."""
    return {name: plan.scenes[name] for name in plan.train_scenes}


class Train(RanksStep):
    name = TrainJob.KIND
    section = "train"

    def start_inputs(self, wildcards: Any = None) -> dict[str, str]:
        """The files training starts from (train.init, model.backbone_weights), by rule input name."""
        settings = self.plan.settings
        starts = (("init", settings.train.init), ("backbone_weights", settings.model.backbone_weights))
        return {key: path for key, path in starts if path}

    def inputs(self) -> dict[str, Any]:
        """The training scenes' rasters, annotations and manifests (their batches' tiles records: Tiles), the
        job file."""
        plan = self.plan
        names = plan.train_scenes
        return {
            "rasters": plan.raster_inputs(*names),
            "annotations": [plan.scene_annotations(name) for name in names],
            "manifests": Tiles(plan).manifest_inputs(names),
            "job": self.job_file(),
        }

    def outputs(self, model: str) -> dict[str, str]:
        """Everything training writes for a model: the model file (for detection, its DeepForest folder too) and
        its curves (plot and CSV)."""
        return {key: paths.models_file(file.format(name=model)) for key, file in self.plan.task.model_files.items()}

    def job(self) -> TrainJob:
        plan = self.plan
        settings = self.carrying("task", "model", "tiling", "train", scenes=training_entries(plan))
        return TrainJob(tuple(plan.truth_scene(name) for name in plan.train_scenes), settings)

    def job_files(self) -> JobFiles:
        if self.plan.train_scenes:
            yield self.job_file(), self.job()

    def targets(self) -> list[str]:
        """The trained model's files, when the run trains one."""
        return list(self.outputs(self.plan.run).values()) if self.plan.trains else []
