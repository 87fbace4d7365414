"""What the workflow hands its jobs, typed, one class per job input, each holding its scenes as
:class:`rasterscale.scene.Scene`: a batch's job file (:class:`PredictionBatch`,
``results/{run}/batches/batch-{batch}.json``, read by the tile manifest, prediction and merge jobs of the batch), the
training scenes (:class:`TrainingScenes`), a merge job's config (:class:`MergeConfig`) and a scene's evaluation
(:class:`EvaluationJob`). The plan writes them (``rasterscale.workflow.plan``), the entry scripts read them with
``from_json``/``read``. JSON, one writer and one reader each. No torch here: the jobs that read these start in a
second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasterscale.atomic import atomic_path
from rasterscale.scene import Scene

COMPACT = (",", ":")


@dataclass(frozen=True)
class PredictionBatch:
    """A batch's job file: its number and its scenes, each with raster, manifest, imagery keys, rank files and
    merged outputs."""

    batch: int
    scenes: tuple[Scene, ...]

    def to_json(self) -> str:
        return json.dumps({"batch": self.batch, "scenes": [s.to_dict() for s in self.scenes]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PredictionBatch:
        data = json.loads(text)
        return cls(int(data.get("batch", 0)), tuple(Scene.from_dict(s) for s in data["scenes"]))

    def write(self, path: str | Path, log: str | Path | None = None) -> None:
        """Write the job file atomically, and one line naming its scenes into ``log``."""
        with atomic_path(path) as tmp:
            Path(tmp).write_text(self.to_json() + "\n")
        if log is not None:
            names = ", ".join(s.name for s in self.scenes)
            Path(log).write_text(f"{path}: {len(self.scenes)} scene(s): {names}\n")

    @classmethod
    def read(cls, path: str | Path) -> PredictionBatch:
        return cls.from_json(Path(path).read_text())


@dataclass(frozen=True)
class TrainingScenes:
    """The scenes a training job reads (its ``--scenes``): raster, manifest and ground truth each."""

    scenes: tuple[Scene, ...]

    def to_json(self) -> str:
        return json.dumps([s.to_dict() for s in self.scenes], separators=COMPACT)

    @classmethod
    def from_json(cls, text: str) -> TrainingScenes:
        return cls(tuple(Scene.from_dict(s) for s in json.loads(text)))


@dataclass(frozen=True)
class MergeConfig:
    """What a merge job uses (its ``--config``): the task, the resolved class names, the merge and predict
    sections."""

    task: str
    labels: tuple[str, ...]
    merge: dict[str, Any]
    predict: dict[str, Any]

    def as_mapping(self) -> dict[str, Any]:
        return {"task": self.task, "labels": list(self.labels), "merge": self.merge, "predict": self.predict}

    def to_json(self) -> str:
        return json.dumps(self.as_mapping(), separators=COMPACT)

    @classmethod
    def from_json(cls, text: str) -> MergeConfig:
        data = json.loads(text)
        return cls(data["task"], tuple(data["labels"]), data.get("merge", {}), data.get("predict", {}))


@dataclass(frozen=True)
class EvaluationJob:
    """A scene's evaluation (its ``--job``): the scene (raster, merged outputs, ground truth), the task, the
    ``evaluate`` section and the resolved class names."""

    scene: Scene
    task: str
    evaluate: dict[str, Any]
    labels: tuple[str, ...]

    def config(self) -> dict[str, Any]:
        """The config sections a task's evaluation reads."""
        return {"task": self.task, "evaluate": self.evaluate}

    def to_json(self) -> str:
        data = {"scene": self.scene.to_dict(), "task": self.task, "evaluate": self.evaluate, "labels": self.labels}
        return json.dumps(data, separators=COMPACT)

    @classmethod
    def from_json(cls, text: str) -> EvaluationJob:
        data = json.loads(text)
        return cls(Scene.from_dict(data["scene"]), data["task"], data["evaluate"], tuple(data["labels"]))


@dataclass(frozen=True)
class ProjectJob:
    """What the project's merge reads (``results/{run}/project/job.json``): the task, the project's CRS, the class
    names, the merge and project sections, each source (scene or seam) with its merged outputs by key, its CRS, and its
    footprint (a scene's ``bounds``) or core (a seam's, WKT); and the project's outputs by key."""

    task: str
    crs: str
    labels: tuple[str, ...]
    merge: dict[str, Any]
    project: dict[str, Any]
    sources: tuple[dict[str, Any], ...]
    outputs: dict[str, str]

    def as_mapping(self) -> dict[str, Any]:
        """The job as the task's project merge reads it."""
        data = {"task": self.task, "crs": self.crs, "labels": list(self.labels), "merge": self.merge}
        data["project"] = self.project
        return {**data, "sources": list(self.sources), "outputs": self.outputs}

    def to_json(self) -> str:
        return json.dumps(self.as_mapping(), separators=COMPACT)

    @classmethod
    def from_json(cls, text: str) -> ProjectJob:
        data = json.loads(text)
        sources = tuple(data["sources"])
        labels = tuple(data["labels"])
        return cls(data["task"], data["crs"], labels, data["merge"], data["project"], sources, data["outputs"])

    @classmethod
    def read(cls, path: str | Path) -> ProjectJob:
        return cls.from_json(Path(path).read_text())

    def write(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            Path(tmp).write_text(self.to_json() + "\n")


def read_job_file(path: str | Path) -> list[Scene]:
    """The scenes of a batch's job file, in order."""
    return list(PredictionBatch.read(path).scenes)
