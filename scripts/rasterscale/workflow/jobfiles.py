"""What the workflow hands its jobs, typed: a scene as the jobs see it (:class:`SceneJob`), and one class per job
input: a batch's job file (:class:`PredictionBatch`, ``results/batches/batch-{batch}.json``, read by the tile
manifest, prediction and merge jobs of the batch), the training scenes (:class:`TrainingScenes`), a merge job's
config (:class:`MergeConfig`) and a scene's evaluation (:class:`EvaluationJob`). The plan writes them
(``rasterscale.workflow.plan``), the entry scripts read them with ``from_json``/``read``. JSON, one writer and one
reader each; a scene's merged outputs are flat keys of its entry (``gpkg``, ``classes``, ``profile``, ...), as a
task's merge and evaluation read them. No torch here: the jobs that read these start in a second.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasterscale.atomic import atomic_path

COMPACT = (",", ":")


@dataclass(frozen=True)
class Imagery:
    """A scene's imagery keys for its manifest's imagery spec: its config key, bands and scale (None: defaults)."""

    key: str = "scene"
    bands: list[int] | None = None
    scale: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "bands": self.bands, "scale": self.scale}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Imagery:
        return cls(data.get("key", "scene"), data.get("bands"), data.get("scale"))


# SceneJob's fields other than its outputs (the outputs are the other keys of its JSON entry)
_SCENE_FIELDS = ("name", "raster", "manifest", "imagery", "annotations", "label_column", "image_path", "rank_files")


@dataclass(frozen=True)
class SceneJob:
    """A scene as a job sees it: the raster it is read from, its tile manifest, and what the job at hand needs
    of the rest: its imagery keys (tile manifest), ground truth (training, evaluation), rank files (merge),
    merged outputs by key (merge, evaluation)."""

    name: str
    raster: str
    manifest: str
    imagery: Imagery | None = None
    annotations: str = ""
    label_column: str | None = None
    image_path: str | None = None  # the scene's image name in CSV/VOC annotations (detection)
    rank_files: tuple[str, ...] = ()
    outputs: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON entry: name, raster, manifest, the other fields that are set, and the outputs as flat keys."""
        data: dict[str, Any] = {"name": self.name, "raster": self.raster, "manifest": self.manifest}
        if self.imagery is not None:
            data["imagery"] = self.imagery.to_dict()
        if self.annotations:
            data.update(annotations=self.annotations, label_column=self.label_column, image_path=self.image_path)
        if self.rank_files:
            data["rank_files"] = list(self.rank_files)
        return {**data, **self.outputs}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SceneJob:
        imagery = data.get("imagery")
        return cls(
            name=data["name"],
            raster=data["raster"],
            manifest=data["manifest"],
            imagery=Imagery.from_dict(imagery) if imagery is not None else None,
            annotations=data.get("annotations") or "",
            label_column=data.get("label_column"),
            image_path=data.get("image_path"),
            rank_files=tuple(data.get("rank_files", ())),
            outputs={key: value for key, value in data.items() if key not in _SCENE_FIELDS},
        )

    def as_mapping(self) -> dict[str, Any]:
        """Every field by name, the outputs as flat keys: the ``scene`` a task's merge and evaluation read."""
        return {
            "name": self.name,
            "raster": self.raster,
            "manifest": self.manifest,
            "annotations": self.annotations,
            "label_column": self.label_column,
            "image_path": self.image_path,
            "rank_files": list(self.rank_files),
            **self.outputs,
        }


@dataclass(frozen=True)
class PredictionBatch:
    """A batch's job file: its number and its scenes, each with raster, manifest, imagery keys, rank files and
    merged outputs."""

    batch: int
    scenes: tuple[SceneJob, ...]

    def to_json(self) -> str:
        return json.dumps({"batch": self.batch, "scenes": [s.to_dict() for s in self.scenes]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PredictionBatch:
        data = json.loads(text)
        return cls(int(data.get("batch", 0)), tuple(SceneJob.from_dict(s) for s in data["scenes"]))

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

    scenes: tuple[SceneJob, ...]

    def to_json(self) -> str:
        return json.dumps([s.to_dict() for s in self.scenes], separators=COMPACT)

    @classmethod
    def from_json(cls, text: str) -> TrainingScenes:
        return cls(tuple(SceneJob.from_dict(s) for s in json.loads(text)))


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

    scene: SceneJob
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
        return cls(SceneJob.from_dict(data["scene"]), data["task"], data["evaluate"], tuple(data["labels"]))


def read_job_file(path: str | Path) -> list[SceneJob]:
    """The scenes of a batch's job file, in order."""
    return list(PredictionBatch.read(path).scenes)
