"""Job files: what the workflow hands each job, typed, one class per kind of job. The plan writes them
(:mod:`rasterscale.workflow.jobfiles`), every job reads its own with :meth:`JobFile.read` and nothing else: no
setting reaches a job as a command-line flag, a JSON argument or a reload of the plan (its command line names only
its job file and the outputs and logs Snakemake gives it).

A job file holds the job's members (its scenes, each a :class:`rasterscale.scene.Scene`; its model file; its
batch's number ...) and its settings: the :class:`rasterscale.settings.Settings` of the sections it uses and
no other (a job reruns when its file changes, so only when what it uses changes; reading a section it does not
carry is an error naming it). A setting travels once: ``tiling.patch_size`` reaches a batch's tile manifests and
its prediction from the same field of the same config, frozen into both jobs' files.

JSON, written atomically; read back into the same classes (a file of another format or kind is an error naming
it). No torch here: the jobs that read these start in a second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from rasterscale.atomic import atomic_path
from rasterscale.scene import ProjectSource, Scene
from rasterscale.settings import Settings, carried, job_settings

FORMAT = "rasterscale-job/1"
J = TypeVar("J", bound="JobFile")


class JobFileError(ValueError):
    """A job file that is not one this version writes for this job: one line naming it."""


@dataclass(frozen=True)
class JobFile:
    """A job's file: its members (the subclass's fields) and the settings it uses (``settings``)."""

    KIND: ClassVar[str] = ""

    def to_data(self) -> dict[str, Any]:
        """The file's JSON value: format, kind, and each field encoded."""
        data = {"format": FORMAT, "kind": self.KIND}
        data.update({field.name: _encode(getattr(self, field.name)) for field in dataclasses.fields(self)})
        return data

    def to_json(self) -> str:
        """The file's text: compact JSON (Python's JSON encoder is C only without indentation: 100,000 scenes'
        job files are 1.7 GB)."""
        return json.dumps(self.to_data(), separators=(",", ":"))

    @classmethod
    def from_json(cls: type[J], text: str, source: str = "job file") -> J:
        data = json.loads(text)
        if data.get("format") != FORMAT or data.get("kind") != cls.KIND:
            found = f"{data.get('format')} {data.get('kind')}"
            raise JobFileError(f"{source}: a job file of {found}, not {FORMAT} {cls.KIND}: rerun the workflow")
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _decode(hints[f.name], data[f.name]) for f in dataclasses.fields(cls)})

    @classmethod
    def read(cls: type[J], path: str | Path) -> J:
        try:
            return cls.from_json(Path(path).read_text(), str(path))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            reason = f"{type(err).__name__}: {err}"
            raise JobFileError(f"{path}: unreadable job file ({reason}): rerun the workflow") from None

    def write(self, path: str | Path) -> bool:
        """Write the file atomically when its content differs from what ``path`` holds; whether it did. An
        unchanged job file keeps its time, so its job does not rerun: one of the same JSON values in another
        layout (an earlier version's, indented) is rewritten in this one with its time kept."""
        text = self.to_json() + "\n"
        target = Path(path)
        try:
            found = target.read_text()
            if found == text:
                return False
            kept = target.stat() if json.loads(found) == json.loads(text) else None
        except (OSError, ValueError):
            kept = None
        with atomic_path(target) as tmp:
            Path(tmp).write_text(text)
        if kept is not None:
            os.utime(target, ns=(kept.st_atime_ns, kept.st_mtime_ns))
        return kept is None


JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def _encode(value: Any) -> Any:
    """A member as its JSON value (dispatched on its exact type first: at 100,000 scenes the job files hold tens of
    millions of values)."""
    kind = type(value)
    if kind in JSON_SCALARS:
        return value
    if kind is dict:
        return {key: _encode(item) for key, item in value.items()}
    if kind is tuple or kind is list:
        return [_encode(item) for item in value]
    if kind is Scene or kind is ProjectSource:
        return value.to_dict()
    if isinstance(value, Settings):
        return carried(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _encode(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_encode(item) for item in value]
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    return value


def _decode(hint: Any, value: Any) -> Any:
    if hint is Settings:
        return job_settings(value)
    if hint is Scene:
        return Scene.from_dict(value)
    if hint is ProjectSource:
        return ProjectSource.from_dict(value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: _decode(hints[f.name], value[f.name]) for f in dataclasses.fields(hint)})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return tuple(_decode(args[0], item) for item in value)
    if origin is dict:
        return {key: _decode(args[1], item) for key, item in value.items()}
    return value


# -- the plan's batches (stored with the plan; the jobs of a batch get files of their own) -----------------------


@dataclass(frozen=True)
class PredictionBatch:
    """A batch of the plan: its number and its scenes, each with raster, manifest, imagery keys, rank files and
    merged outputs."""

    batch: int
    scenes: tuple[Scene, ...]


# -- one class per job ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TilesJob(JobFile):
    """Tile manifests (rules tiles_batch_{b}, tiles): each scene's raster (a seam's mosaic of its
    scenes' rasters, written first), manifest and imagery keys; settings: tiling."""

    KIND: ClassVar[str] = "tiles"
    scenes: tuple[Scene, ...]
    settings: Settings
    # scene -> the header the plan trusted (rasterscale.raster.item_header.ItemHeader.to_dict): the job compares
    trusted: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    records: str = ""  # the folder of the records of scenes whose raster is not what their STAC item said

    def to_data(self) -> dict[str, Any]:
        """Without ``trusted`` and ``records`` when no scene's header was trusted: the file of a job without STAC
        items is as before (an unchanged job file does not rerun its job)."""
        data = super().to_data()
        if not self.trusted:
            del data["trusted"], data["records"]
        return data

    @classmethod
    def from_json(cls, text: str, source: str = "job file") -> TilesJob:
        data = json.loads(text)
        data.setdefault("trusted", {})
        data.setdefault("records", "")
        return super().from_json(json.dumps(data), source)


@dataclass(frozen=True)
class PredictJob(JobFile):
    """A batch's prediction (rule predict, one job a shard): its scenes (raster, manifest, imagery, rank files), the
    model file, the number of shards; settings: task, model, tiling, predict (without predict.scenes: adding a
    scene to another batch does not rerun this one)."""

    KIND: ClassVar[str] = "predict"
    batch: int
    scenes: tuple[Scene, ...]
    model_file: str
    shards: int
    settings: Settings


@dataclass(frozen=True)
class MergeJob(JobFile):
    """A batch's merge (rules merge_batch_{b}): each scene's rank files into its layers, with the resolved class
    names; settings: task, merge, predict (without predict.scenes)."""

    KIND: ClassVar[str] = "merge"
    batch: int
    scenes: tuple[Scene, ...]
    labels: tuple[str, ...]
    settings: Settings


@dataclass(frozen=True)
class ScoredScene:
    """A scene a scoring job scores and renders: the scene (raster, manifest, ground truth, merged outputs), its
    evaluation and quicklook files ("" evaluation: no annotations, the quicklook alone) and its report pages."""

    scene: Scene
    evaluation: str
    quicklook: str
    pages: dict[str, str]


@dataclass(frozen=True)
class ScoreJob(JobFile):
    """A batch's scoring (rules score_batch_{b}): its predicted scenes; settings: task, evaluate."""

    KIND: ClassVar[str] = "score"
    batch: int
    scenes: tuple[ScoredScene, ...]
    labels: tuple[str, ...]
    settings: Settings


@dataclass(frozen=True)
class ProjectJob(JobFile):
    """The project's merge (rule project), or one partition's (rule project_partition,
    :mod:`rasterscale.grid.partitions`): the project's CRS, the class names, each source (scene or seam) whose
    objects it reads, with its merged outputs by key, its CRS and its footprint (a scene's ``bounds``) or core (a
    seam's, WKT), and the project's outputs by key (a partition's: ``partition``); a partition's also the sources
    it keeps the objects of (``owners``) and the ``areas`` (sources without outputs) of its neighbours' neighbours;
    settings: task, merge, project."""

    KIND: ClassVar[str] = "project"
    crs: str
    labels: tuple[str, ...]
    sources: tuple[ProjectSource, ...]
    outputs: dict[str, str]
    settings: Settings
    owners: tuple[str, ...] = ()
    areas: tuple[ProjectSource, ...] = ()


@dataclass(frozen=True)
class SummaryJob(JobFile):
    """The project's summary raster (rule summary, :mod:`rasterscale.raster.summary`): the project's CRS,
    the class names, the layer files it reads (a partitioned layer's files, the layer's GeoParquet file, or the
    mosaic of a raster task), the file it writes; settings: task, project."""

    KIND: ClassVar[str] = "summary"
    crs: str
    labels: tuple[str, ...]
    layers: tuple[str, ...]
    output: str
    settings: Settings


@dataclass(frozen=True)
class TrainJob(JobFile):
    """The training (rule train): its scenes (raster, manifest, ground truth); settings: task, model, tiling,
    train and the training scenes' entries of ``scenes`` (their bands and normalize make the model's input), not
    the other scenes' (adding a scene to predict does not retrain)."""

    KIND: ClassVar[str] = "train"
    scenes: tuple[Scene, ...]
    settings: Settings


@dataclass(frozen=True)
class CheckJob(JobFile):
    """The environment check (rule check_environment): settings: task, model, tiling, train (its model starts from
    train.init when there is no model.file), predict, dummy."""

    KIND: ClassVar[str] = "check_environment"
    settings: Settings


@dataclass(frozen=True)
class SynthesisJob(JobFile):
    """A demo scene's synthesis (rule demo): its name; settings: demo, with this scene only."""

    KIND: ClassVar[str] = "demo"
    name: str
    settings: Settings


@dataclass(frozen=True)
class RunPageJob(JobFile):
    """The report's page of the run (rule report_run_page): the class names, each DDP section's launch geometry
    (``devices, nodes, world_size, shards, threads``), the model file and whether this run trains it, each predicted
    scene's gathered profile (the precision its ranks ran at), the scenes left out (scenes_on_error: skip) and why;
    settings: all of them (the page shows the config)."""

    KIND: ClassVar[str] = "run_page"
    labels: tuple[str, ...]
    geometry: dict[str, dict[str, int]]
    model_file: str
    trained: bool
    profiles: dict[str, str]
    settings: Settings
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # scene -> why (scenes_on_error: skip)


@dataclass(frozen=True)
class ProjectMapJob(JobFile):
    """The report's project map (rule report_project_map): each scene the run reads, with its raster (its header
    gives the footprint), its roles (``train``, ``predict``) and, for a predicted scene, the counts file its
    scoring job wrote; the project's summary raster when the run has a project; settings: task."""

    KIND: ClassVar[str] = "project_map"
    scenes: tuple[dict[str, Any], ...]
    settings: Settings
    summary: str = ""  # the project's summary raster, drawn under the footprints (a run of several scenes)
