"""The workflow's plan: everything the rules need, computed once from the raw Snakemake config.

:func:`build_plan` validates the config, checks every scene's inputs (raster, imagery keys, annotations, the
validation band of a training scene) and the model file's labels, and returns a frozen :class:`Plan`: the
validated config, its notices, where each scene came from, the effective labels, the striped scenes, the batches
of scenes and the launch geometry of each section ("train", "predict"). Its methods give the rules' inputs,
outputs and job inputs (``rasterscale.workflow.jobfiles``), with paths from ``rasterscale.workflow.paths``.

A plan is stored as JSON under ``.snakemake/rasterscale/plan-{fingerprint}.json`` (:func:`store_plan`), the
fingerprint a hash of the raw config; with it the files its checks read, by size and mtime. The main Snakemake
process builds and stores it every invocation; a job's re-parse (cluster or subprocess) loads it
(:func:`load_plan`) instead of reading every header again, and builds it itself when none is stored for its
config or an input changed since. Problems raise :class:`ConfigError` or :class:`InputError` (one line).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rasterscale.atomic import atomic_path
from rasterscale.config.scenes import scene_key
from rasterscale.config.schema import nothing_to_do, validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.grid.split import check_validation_band
from rasterscale.raster.cog import striped_sources
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import check_imagery
from rasterscale.raster.remote import check_tiled, file_name, is_remote, local_files
from rasterscale.runtime.preflight import Geometry, launch_geometry
from rasterscale.scene import Imagery, Scene
from rasterscale.tasks.registry import task_spec
from rasterscale.tasks.spec import TaskSpec
from rasterscale.workflow import paths
from rasterscale.workflow.checks import unwritable_folder
from rasterscale.workflow.jobfiles import EvaluationJob, MergeConfig, PredictionBatch, TrainingScenes

SECTIONS = ("train", "predict")
FORMAT = 1  # of a stored plan: a plan stored in another format is rebuilt


@dataclass(frozen=True)
class Plan:
    """The validated config and what its checks found, and everything the rules derive from them."""

    config: dict[str, Any]
    notices: tuple[str, ...] = ()  # warnings: renamed keys, scenes scored on their training data
    origins: dict[str, str] = field(default_factory=dict)  # scene -> its scene table's file and line
    labels: tuple[str, ...] = ()  # the effective class names (config keys over the model file's)
    untiled: dict[str, tuple[str, ...]] = field(default_factory=dict)  # scene -> its striped rasters
    geometry: dict[str, Geometry] = field(default_factory=dict)  # section -> launch geometry
    batches: tuple[tuple[str, ...], ...] = ()  # predict.scenes, predict.scenes_per_job at a time
    inputs: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # file -> (size, mtime_ns) checked

    # -- the config -------------------------------------------------------------------------------------------

    @property
    def task(self) -> TaskSpec:
        return task_spec(self.config["task"])

    @property
    def scenes(self) -> dict[str, Any]:
        return self.config["scenes"]

    @property
    def train_scenes(self) -> list[str]:
        return list(self.config["train"]["scenes"])

    @property
    def predict_scenes(self) -> list[str]:
        return list(self.config["predict"]["scenes"])

    def section(self, name: str) -> dict[str, Any]:
        """The config section of a DDP section by name ("train" or "predict")."""
        if name not in SECTIONS:
            raise ValueError(f"no run section '{name}' (train or predict)")
        return self.config[name]

    def sections(self, *names: str) -> dict[str, Any]:
        """The validated config's given sections (what a job uses: it reruns only when they change)."""
        return {name: self.config[name] for name in names}

    def world_size(self, section: str) -> int:
        """Ranks of one job of a DDP section (for prediction: of one shard)."""
        return self.geometry[section].world_size

    @property
    def shards(self) -> int:
        return self.geometry["predict"].shards

    def rank_threads(self, section: str) -> int:
        values = self.section(section)
        return int(values["devices"]) * (int(values["workers"]) + 1)

    def nothing_to_do(self) -> str | None:
        return nothing_to_do(self.config)

    # -- scenes -----------------------------------------------------------------------------------------------

    def scene_source(self, name: str) -> str:
        """The raster the config names for a scene."""
        return str(self.scenes[name]["path"])

    def scene_raster(self, name: str) -> str:
        """The raster a scene is read from: its own, or the tiled COG made from it when its own is striped."""
        return paths.cog_raster(name) if name in self.untiled else self.scene_source(name)

    def raster_inputs(self, *names: str) -> list[str]:
        """The rasters of these scenes as a rule's inputs: the local ones (a remote raster is no file Snakemake
        could wait for; the job reads it by its URL from its job file or params)."""
        return local_files(self.scene_raster(name) for name in names)

    def scene_annotations(self, name: str) -> str:
        return str(self.scenes[name].get("annotations") or "")

    def scene_image_name(self, name: str) -> str:
        """The image name a scene's CSV/VOC annotations give its boxes under (scenes.X.image_path)."""
        return str(self.scenes[name].get("image_path") or file_name(self.scene_source(name)))

    def scene_imagery(self, name: str) -> Imagery:
        """The scene's imagery keys (bands, scale) for its manifest's imagery spec."""
        scene = self.scenes[name]
        return Imagery(f"scenes.{name}", scene.get("bands"), scene.get("scale"))

    def scene_outputs(self, name: str) -> dict[str, str]:
        """A scene's merged outputs (the task's, and the gathered profile), by the merge's keys."""
        files = {key: paths.scene_file(name, file) for key, file in self.task.scene_outputs(self.config).items()}
        return {**files, "profile": paths.scene_profile(name)}

    def demo_raster(self, name: str) -> str:
        return paths.demo_raster(self.config["demo"]["directory"], name)

    def evaluated_scenes(self) -> list[str]:
        return [name for name in self.predict_scenes if self.scene_annotations(name)]

    def unbatched_scenes(self) -> list[str]:
        """The scenes no batch makes the manifest of (training-only scenes: rule tile_manifest)."""
        predicted = set(self.predict_scenes)
        return [name for name in self.scenes if name not in predicted]

    def striped_warnings(self) -> list[str]:
        """One warning per striped scene the run reads: it is read from a tiled COG."""
        used = {*self.train_scenes, *self.predict_scenes}
        warnings = []
        for name in [name for name in self.scenes if name in self.untiled and name in used]:
            source = self.scene_source(name)
            striped = list(self.untiled[name])
            what = f"{source} is striped, not tiled" if striped == [source] else f"{source} reads striped rasters"
            warnings.append(
                f"{what}: every windowed read would decode whole raster rows; scene {name} is read from the tiled "
                f"COG {paths.cog_raster(name)} (rule convert_to_cog)"
            )
        return warnings

    # -- prediction -------------------------------------------------------------------------------------------

    def rank_files(self, name: str, batch: int) -> list[str]:
        """A scene's rank files (paths without suffix), every shard's, in rank order."""
        return paths.rank_files(name, batch, self.shards, self.world_size("predict"))

    def prediction_batch(self, batch: int) -> PredictionBatch:
        """A batch's job file: each scene's raster, manifest, imagery keys, rank files and outputs."""
        scenes = tuple(
            Scene(
                name=name,
                raster=self.scene_raster(name),
                manifest=paths.scene_manifest(name),
                imagery=self.scene_imagery(name),
                rank_files=tuple(self.rank_files(name, batch)),
                outputs=self.scene_outputs(name),
            )
            for name in self.batches[batch]
        )
        return PredictionBatch(batch, scenes)

    def batch_inputs(self, batch: int) -> dict[str, list[str]]:
        """The rasters and manifests of a batch's scenes."""
        names = self.batches[batch]
        return {"rasters": self.raster_inputs(*names), "manifests": [paths.scene_manifest(n) for n in names]}

    def batch_outputs(self, batch: int) -> list[str]:
        return [path for name in self.batches[batch] for path in self.scene_outputs(name).values()]

    def predict_config(self) -> dict[str, Any]:
        """The task, model, tiling and predict sections a prediction job uses (not predict.scenes: the job file
        has them)."""
        return {
            "task": self.config["task"],
            "model": self.config["model"],
            "tiling": self.config["tiling"],
            "predict": self._predict_section(),
        }

    def merge_config(self) -> MergeConfig:
        """What a merge job uses: the task, the resolved class names, the merge and predict sections."""
        return MergeConfig(self.config["task"], self.labels, self.config["merge"], self._predict_section())

    def _predict_section(self) -> dict[str, Any]:
        """The predict section without predict.scenes (a job's file lists its scenes)."""
        return {key: value for key, value in self.config["predict"].items() if key != "scenes"}

    def checkpoint_path(self) -> str:
        """The model file prediction reads: model.checkpoint, or the one training writes."""
        model = self.config["model"]
        return str(model["checkpoint"] or paths.trained_model(model["name"]))

    # -- training and evaluation ------------------------------------------------------------------------------

    def training_scenes(self) -> TrainingScenes:
        return TrainingScenes(tuple(self._truth_scene(name) for name in self.train_scenes))

    def train_start_inputs(self) -> dict[str, str]:
        """The files training starts from (train.init, model.backbone_weights), by rule input name."""
        starts = (
            ("init", self.config["train"]["init"]),
            ("backbone_weights", self.config["model"]["backbone_weights"]),
        )
        return {key: path for key, path in starts if path}

    def trained_model_outputs(self, name: str) -> dict[str, str]:
        """Everything training writes for a model: the model file (for detection, its DeepForest folder too),
        curves."""
        return {key: paths.model_file(file.format(name=name)) for key, file in self.task.model_files.items()}

    def evaluation_job(self, name: str) -> EvaluationJob:
        """What a scene's evaluation reads: its raster, its merged outputs, its ground truth; the evaluate
        section and the labels."""
        scene = self._truth_scene(name, outputs=self.scene_outputs(name))
        return EvaluationJob(scene, self.config["task"], self.config["evaluate"], self.labels)

    def _truth_scene(self, name: str, outputs: dict[str, str] | None = None) -> Scene:
        return Scene(
            name=name,
            raster=self.scene_raster(name),
            manifest=paths.scene_manifest(name),
            annotations=self.scene_annotations(name),
            label_column=self.scenes[name].get("label_column"),
            image_path=self.scene_image_name(name),
            outputs=outputs or {},
        )

    def final_targets(self) -> list[str]:
        """Everything the config asks for: the trained model, each predicted scene's outputs, evaluations."""
        targets: list[str] = []
        if self.train_scenes and not self.config["model"]["checkpoint"]:
            targets += list(self.trained_model_outputs(self.config["model"]["name"]).values())
        for name in self.predict_scenes:
            targets += list(self.scene_outputs(name).values())
        for name in self.evaluated_scenes():
            targets += [paths.evaluation_file(name), paths.quicklook_file(name)]
        return targets

    # -- storage ----------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = {
            "format": FORMAT,
            "config": self.config,
            "notices": list(self.notices),
            "origins": self.origins,
            "labels": list(self.labels),
            "untiled": {name: list(files) for name, files in self.untiled.items()},
            "geometry": {s: [g.section, g.devices, g.nodes, g.shards] for s, g in self.geometry.items()},
            "batches": [list(batch) for batch in self.batches],
            "inputs": {path: list(stat) if stat else None for path, stat in self.inputs.items()},
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"stored plan of format {data.get('format')}, not {FORMAT}")
        return cls(
            config=data["config"],
            notices=tuple(data["notices"]),
            origins=dict(data["origins"]),
            labels=tuple(data["labels"]),
            untiled={name: tuple(files) for name, files in data["untiled"].items()},
            geometry={s: Geometry(g[0], int(g[1]), int(g[2]), int(g[3])) for s, g in data["geometry"].items()},
            batches=tuple(tuple(batch) for batch in data["batches"]),
            inputs={path: (int(s[0]), int(s[1])) if s else None for path, s in data["inputs"].items()},
        )


# -- building ---------------------------------------------------------------------------------------------------


def build_plan(raw: Mapping[str, Any], workdir: str | Path = ".", warn: Callable[[str], None] | None = None) -> Plan:
    """Validate the raw config, check every scene's existing inputs (so also on ``snakemake -n``) and return the
    plan. ``warn`` gets each notice as soon as the config is validated (so before a later error) and each striped
    scene's warning. Raises ConfigError or InputError; an error of a scene from a scene table names its line."""
    origins: dict[str, str] = {}
    notices: list[str] = []
    default_bands: set[str] = set()
    config = validate_config(raw, origins=origins, notices=notices, default_bands=default_bands)
    say = warn if warn is not None else _silent
    for notice in notices:
        say(notice)
    demo = config["demo"]
    unwritable = unwritable_folder(workdir, [demo["directory"]] if demo["scenes"] else [])
    if unwritable is not None:
        raise InputError(
            f"{Path(unwritable).resolve()}: folder is not writable, and the workflow writes into it; make it "
            "writable (chmod u+w), or run in a folder you can write (--directory)"
        )
    geometry = {section: launch_geometry(config, section) for section in SECTIONS}
    labels = tuple(task_spec(config["task"]).labels(config))  # use these, never model.labels
    plan = Plan(config, tuple(notices), origins, labels, geometry=geometry, batches=_batches(config["predict"]))
    untiled = {}
    for name, scene in config["scenes"].items():
        striped = _check_scene(plan, name, scene, default_bands)
        if striped:
            untiled[name] = tuple(striped)
    inputs = {path: file_stat(Path(workdir) / path) for path in checked_files(config)}
    plan = replace(plan, untiled=untiled, inputs=inputs)
    for line in plan.striped_warnings():
        say(line)
    return plan


def _silent(line: str) -> None:
    pass


def _batches(predict: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    scenes, size = list(predict["scenes"]), int(predict["scenes_per_job"])
    return tuple(tuple(scenes[start : start + size]) for start in range(0, len(scenes), size))


def _check_scene(plan: Plan, name: str, scene: Mapping[str, Any], default_bands: set[str]) -> list[str]:
    """Header checks of one scene's existing inputs; its striped rasters (none when tiled or absent)."""
    config = plan.config
    path = scene["path"]
    demo = name in config["demo"]["scenes"]
    if demo and path != plan.demo_raster(name):
        raise ConfigError(f"scenes.{name}: a demo scene's path must be {plan.demo_raster(name)}")
    if not is_remote(path) and not Path(path).exists():
        if demo:
            return []
        raise InputError(f"{path}: raster not found ({scene_key(name, 'path', plan.origins)})")
    try:
        raster = check_raster(path)
        bands = None if name in default_bands else scene.get("bands")
        check_imagery(raster, bands, scene.get("scale"), f"scenes.{name}")
        if name in config["train"]["scenes"] and not config["model"]["checkpoint"]:
            tiling, train = config["tiling"], config["train"]
            check_validation_band(raster, name, tiling["patch_size"], tiling["overlap"], train["validation_fraction"])
        striped = striped_sources(path)
        check_tiled(path, striped)
        annotations = scene.get("annotations")
        if annotations and (Path(annotations).exists() or not demo):
            image_name = plan.scene_image_name(name)
            plan.task.check_annotations(annotations, raster, list(plan.labels), scene.get("label_column"), image_name)
    except InputError as err:
        if name in plan.origins:
            raise InputError(f"{err} ({plan.origins[name]})") from err
        raise
    return striped


# -- storing and loading ----------------------------------------------------------------------------------------


def fingerprint(raw: Mapping[str, Any]) -> str:
    """The stored plan's key: a hash of the raw config (and the plan's format)."""
    text = json.dumps({"format": FORMAT, "config": raw}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def checked_files(config: Mapping[str, Any]) -> Iterator[str]:
    """The local files a plan's checks read: every scene's raster and annotations, the model files, the STAC items
    scenes came from (a remote one's changes are not watched)."""
    return iter(local_files(_read_files(config)))


def _read_files(config: Mapping[str, Any]) -> Iterator[str]:
    for scene in config["scenes"].values():
        yield str(scene["path"])
        for key in ("annotations", "stac"):
            if scene.get(key):
                yield str(scene[key])
    yield from config["stac"]["items"]
    for path in (config["model"]["checkpoint"], config["train"]["init"], config["model"]["backbone_weights"]):
        if path:
            yield str(path)


def file_stat(path: str | Path) -> tuple[int, int] | None:
    """A file's (size, mtime_ns), None when it does not exist."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_size, stat.st_mtime_ns)


def store_plan(plan: Plan, key: str, workdir: str | Path = ".") -> Path:
    """Write the plan atomically under ``.snakemake/rasterscale/plan-{key}.json``; its path."""
    path = Path(workdir) / paths.stored_plan(key)
    with atomic_path(path) as tmp:
        tmp.write_text(plan.to_json())
    return path


def load_plan(key: str, workdir: str | Path = ".") -> Plan | None:
    """The plan stored under ``key``, or None when there is none, it is unreadable or of another format, or a
    file its checks read changed since (size or mtime)."""
    path = Path(workdir) / paths.stored_plan(key)
    try:
        plan = Plan.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    base = Path(workdir)
    if any(file_stat(base / name) != stat for name, stat in plan.inputs.items()):
        return None
    return plan


def workflow_plan(
    raw: Mapping[str, Any], main_process: bool, workdir: str | Path = ".", warn: Callable[[str], None] | None = None
) -> Plan:
    """The plan of this parse: the main process builds it with every check and stores it; a job's re-parse loads
    the stored one, and builds it (without storing) when none is stored for its config or it is stale."""
    key = fingerprint(raw)
    if not main_process:
        stored = load_plan(key, workdir)
        if stored is not None:
            return stored
        return build_plan(raw, workdir, warn)
    plan = build_plan(raw, workdir, warn)
    store_plan(plan, key, workdir)
    return plan
