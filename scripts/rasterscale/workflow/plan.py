"""The workflow's plan: everything the rules need, computed once from the raw Snakemake config.

:func:`build_plan` validates the config, checks every scene's inputs (raster, imagery keys, annotations, the
validation band of a training scene) and the model file's labels, and returns a frozen :class:`Plan`: the
validated config, its notices, where each scene came from, the effective labels, the striped scenes, the predicted
scenes' footprints and the seams between them (:mod:`rasterscale.grid.project`), the batches of scenes and seams
(:mod:`rasterscale.workflow.batches`: recorded batches are kept) and the launch geometry of each section ("train",
"predict"). Its methods give the rules' inputs,
outputs and job inputs (``rasterscale.workflow.jobfiles``), with paths from ``rasterscale.workflow.paths``.

A plan is stored as JSON under ``.snakemake/rasterscale/plan-{fingerprint}.json`` (:func:`store_plan`), the
fingerprint a hash of the raw config; with it the files its checks read, by size and mtime. The main Snakemake
process builds and stores it every invocation; a job's re-parse (cluster or subprocess) loads it
(:func:`load_plan`) instead of reading every header again, and builds it itself when none is stored for its
config or an input changed since. Problems raise :class:`ConfigError` or :class:`InputError` (one line).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rasterio.crs import CRS
from rasterio.errors import CRSError

from rasterscale.atomic import atomic_path
from rasterscale.config.scenes import scene_key
from rasterscale.config.schema import nothing_to_do, validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.grid.project import Footprint, Seam, find_seams, is_seam
from rasterscale.grid.split import check_validation_band
from rasterscale.raster.bands import InputBands, differs_wildly
from rasterscale.raster.cog import striped_sources
from rasterscale.raster.headers import DEFAULT_BANDS, RasterInfo, check_raster
from rasterscale.raster.imagery import ImageSpec, band_statistics, check_imagery, mask_of
from rasterscale.raster.remote import check_tiled, file_name, is_remote, local_files
from rasterscale.runtime.preflight import Geometry, launch_geometry
from rasterscale.scene import Imagery, Scene
from rasterscale.tasks.registry import task_spec
from rasterscale.tasks.spec import TaskSpec
from rasterscale.workflow import paths
from rasterscale.workflow.batches import form_batches, read_recorded, recorded_targets
from rasterscale.workflow.checks import unwritable_folder
from rasterscale.workflow.jobfiles import EvaluationJob, MergeConfig, PredictionBatch, ProjectJob, TrainingScenes
from rasterscale.workflow.paths import BatchStep

SECTIONS = ("train", "predict")
FORMAT = 4  # of a stored plan: a plan stored in another format is rebuilt
STATISTICS_SIDE = 256  # a predicted scene's statistics, against a raw model's, from a read this small (dry run)


@dataclass(frozen=True)
class Plan:
    """The validated config and what its checks found, and everything the rules derive from them."""

    config: dict[str, Any]
    notices: tuple[str, ...] = ()  # warnings: renamed keys, scenes scored on their training data
    origins: dict[str, str] = field(default_factory=dict)  # scene -> its scene table's file and line
    labels: tuple[str, ...] = ()  # the effective class names (config keys over the model file's)
    untiled: dict[str, tuple[str, ...]] = field(default_factory=dict)  # scene -> its striped rasters
    geometry: dict[str, Geometry] = field(default_factory=dict)  # section -> launch geometry
    batches: tuple[PredictionBatch, ...] = ()  # the prediction jobs' scenes and seams
    inputs: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # file -> (size, mtime_ns) checked
    footprints: dict[str, Footprint] = field(default_factory=dict)  # predicted scene -> its header's footprint
    seams: tuple[Seam, ...] = ()  # between the predicted scenes
    model_input: InputBands = field(default_factory=InputBands)  # the model's bands (config keys over its file's)

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
        """The raster a scene is read from: its own, or the tiled COG made from it when its own is striped; a
        seam's mosaic of its scenes' rasters."""
        if is_seam(name):
            return paths.seam_mosaic(name)
        return paths.cog_raster(name) if name in self.untiled else self.scene_source(name)

    def raster_inputs(self, *names: str) -> list[str]:
        """The rasters of these scenes as a rule's inputs: the local ones (a remote raster is no file Snakemake
        could wait for; the job reads it by its URL from its job file or params)."""
        return local_files(self.scene_raster(name) for name in names)

    def scene_annotations(self, name: str) -> str:
        return str(self.scenes[name].get("annotations") or "")

    def scene_tree_tops(self, name: str) -> str:
        """A scene's true tree tops (scenes.X.tree_tops), which a height model's tops are scored against."""
        return str(self.scenes[name].get("tree_tops") or "")

    def scene_image_name(self, name: str) -> str:
        """The image name a scene's CSV/VOC annotations give its boxes under (scenes.X.image_path)."""
        return str(self.scenes[name].get("image_path") or file_name(self.scene_source(name)))

    def scene_imagery(self, name: str) -> Imagery:
        """The scene's imagery keys (bands, scale) for its manifest's imagery spec (a seam's: its first scene's)."""
        if is_seam(name):
            name = self.seam(name).a
        scene = self.scenes[name]
        return Imagery(f"scenes.{name}", scene.get("bands"), scene.get("scale"), self.model_input.raw)

    def scene_outputs(self, name: str) -> dict[str, str]:
        """A scene's merged outputs (the task's, and the gathered profile), by the merge's keys."""
        files = {key: paths.scene_file(name, file) for key, file in self.task.scene_outputs(self.config).items()}
        return {**files, "profile": paths.scene_profile(name)}

    def demo_raster(self, name: str) -> str:
        return paths.demo_raster(self.config["demo"]["directory"], name)

    def evaluated_scenes(self) -> list[str]:
        return list(self._evaluated)

    @functools.cached_property
    def _evaluated(self) -> tuple[str, ...]:
        """The predicted scenes with annotations (once: the rules ask for them per scene)."""
        return tuple(name for name in self.predict_scenes if self.scene_annotations(name))

    def is_evaluated(self, name: str) -> bool:
        return name in self._evaluated_set

    @functools.cached_property
    def _evaluated_set(self) -> frozenset[str]:
        return frozenset(self._evaluated)

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

    @functools.cached_property
    def _seams_by_name(self) -> dict[str, Seam]:
        return {seam.name: seam for seam in self.seams}

    @functools.cached_property
    def _batches_by_number(self) -> dict[int, PredictionBatch]:
        return {batch.batch: batch for batch in self.batches}

    def seam(self, name: str) -> Seam:
        return self._seams_by_name[name]

    def batch_entry(self, name: str, batch: int) -> Scene:
        """A scene's (or seam's) entry in a batch's job file: raster, manifest, imagery keys, rank files, outputs;
        a seam's mosaicked rasters and core."""
        seam = self.seam(name) if is_seam(name) else None
        return Scene(
            name=name,
            raster=self.scene_raster(name),
            manifest=paths.scene_manifest(name),
            imagery=self.scene_imagery(name),
            rank_files=tuple(self.rank_files(name, batch)),
            outputs=self.scene_outputs(name),
            mosaic=(self.scene_raster(seam.a), self.scene_raster(seam.b)) if seam else (),
            core=seam.core if seam else "",
        )

    @property
    def batch_numbers(self) -> list[int]:
        return [batch.batch for batch in self.batches]

    def prediction_batch(self, batch: int) -> PredictionBatch:
        """A batch's job file: each scene's raster, manifest, imagery keys, rank files and outputs."""
        return self._batches_by_number[batch]

    def batch_inputs(self, batch: int) -> dict[str, list[str]]:
        """The rasters a batch's scenes and seams read, their manifests, and the seams' mosaics."""
        scenes = self.prediction_batch(batch).scenes
        rasters = local_files(raster for scene in scenes for raster in scene.rasters)
        return {
            "rasters": list(dict.fromkeys(rasters)),
            "manifests": [scene.manifest for scene in scenes],
            "mosaics": [scene.raster for scene in scenes if scene.mosaic],
        }

    def batch_outputs(self, batch: int) -> list[str]:
        """A batch's merge job's scene outputs: its scenes' and seams' merged files (its record, the rule's other
        output, is ``paths.batch_record("merged", batch)``)."""
        return [path for scene in self.prediction_batch(batch).scenes for path in scene.outputs.values()]

    def batch_files(self, step: BatchStep, batch: int) -> list[str]:
        """What a batch's job of ``step`` writes besides its record ("tiled": manifests and seams' mosaics;
        "merged": merged layers; the scoring job's are :func:`rasterscale.workflow.reportfiles.scored_files`)."""
        if step == "tiled":
            inputs = self.batch_inputs(batch)
            return [*inputs["manifests"], *inputs["mosaics"]]
        if step == "merged":
            return self.batch_outputs(batch)
        raise ValueError(f"the plan does not list the files of step {step!r}")

    def batches_of(self, names: Iterable[str]) -> list[int]:
        """The batches holding any of these scenes or seams."""
        wanted = set(names)
        return [batch.batch for batch in self.batches if any(scene.name in wanted for scene in batch.scenes)]

    def batch_records(self, step: BatchStep, names: Iterable[str]) -> list[str]:
        """The records of ``step`` of the batches holding any of these scenes or seams: what a job that reads
        their files depends on (:mod:`rasterscale.workflow.batches`)."""
        return [paths.batch_record(step, batch) for batch in self.batches_of(names)]

    # -- the project ------------------------------------------------------------------------------------------

    def has_project(self) -> bool:
        """Whether the run writes the project's layers: it predicts several scenes."""
        return len(self.predict_scenes) > 1

    def project_outputs(self) -> dict[str, str]:
        return {key: paths.project_file(file) for key, file in self.task.project_outputs(self.config).items()}

    def project_inputs(self) -> list[str]:
        """What the project's merge depends on: the merge records of the batches holding its sources (it reads
        each source's layers, which those merges write; its job file names them)."""
        return self.batch_records("merged", self.project_sources())

    def project_sources(self) -> list[str]:
        """The scenes and seams whose layers make the project's, by name (the config's order changes nothing)."""
        return [*sorted(self.predict_scenes), *(seam.name for seam in self.seams)]

    def project_job(self) -> ProjectJob:
        """What the project's merge reads: each source's layers, footprint and CRS, the seams' cores."""
        sources: list[dict[str, Any]] = []
        for name in self.project_sources():
            outputs = self.scene_outputs(name)
            if is_seam(name):
                seam = self.seam(name)
                entry = {"name": name, "crs": self.footprints[seam.a].crs, "core": seam.core, **outputs}
            else:
                footprint = self.footprints.get(name)
                area = {"crs": footprint.crs, "bounds": list(footprint.bounds)} if footprint else {}
                entry = {"name": name, **area, **outputs}  # type: ignore[dict-item]
            sources.append(entry)
        return ProjectJob(
            task=self.config["task"],
            crs=self.project_crs(),
            labels=self.labels,
            merge=self.config["merge"],
            project=self.config["project"],
            sources=tuple(sources),
            outputs=self.project_outputs(),
        )

    def project_crs(self) -> str:
        """project.crs, else the predicted scenes' one CRS (checked when the plan is built)."""
        crs = {footprint.crs for footprint in self.footprints.values()}
        return str(self.config["project"]["crs"] or (crs.pop() if len(crs) == 1 else ""))

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

    def prediction_model(self) -> str:
        """The model file prediction reads: model.file, or the one training writes."""
        model = self.config["model"]
        return str(model["file"] or paths.trained_model(model["name"]))

    # -- training and evaluation ------------------------------------------------------------------------------

    def training_config(self) -> dict[str, Any]:
        """What the training job uses: the task, model, tiling and train sections, and the training scenes' entries
        (their bands and normalize make the model's input: :func:`rasterscale.tasks.modelinput.configured_input`),
        not the other scenes' (adding a scene to predict does not retrain)."""
        return {
            **self.sections("task", "model", "tiling", "train"),
            "scenes": {name: self.scenes[name] for name in self.train_scenes},
        }

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
            tree_tops=self.scene_tree_tops(name),
        )

    def final_targets(self) -> list[str]:
        """Everything the config asks for besides the report: the trained model, the predicted scenes' manifests
        and merged layers (by their batches' records: :func:`rasterscale.workflow.batches.recorded_targets`), the
        project's layers. The scoring jobs' evaluations come with the report's targets
        (:func:`rasterscale.workflow.reportfiles.report_targets`)."""
        targets: list[str] = []
        if self.train_scenes and not self.config["model"]["file"]:
            targets += list(self.trained_model_outputs(self.config["model"]["name"]).values())
        numbers = self.batches_of([*self.predict_scenes, *(seam.name for seam in self.seams)])  # a batch of seams too
        for step in ("tiled", "merged"):
            targets += recorded_targets({paths.batch_record(step, b): self.batch_files(step, b) for b in numbers})
        if self.has_project():
            targets += list(self.project_outputs().values())
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
            "batches": [[b.batch, [scene.to_dict() for scene in b.scenes]] for b in self.batches],
            "inputs": {path: list(stat) if stat else None for path, stat in self.inputs.items()},
            "footprints": {name: footprint.to_list() for name, footprint in self.footprints.items()},
            "seams": [[seam.a, seam.b, seam.core] for seam in self.seams],
            "model_input": self.model_input.to_dict(),
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
            batches=tuple(
                PredictionBatch(int(number), tuple(Scene.from_dict(s) for s in scenes))
                for number, scenes in data["batches"]
            ),
            inputs={path: (int(s[0]), int(s[1])) if s else None for path, s in data["inputs"].items()},
            footprints={name: Footprint.from_list(f) for name, f in data["footprints"].items()},
            seams=tuple(Seam(*seam) for seam in data["seams"]),
            model_input=InputBands.from_dict(data["model_input"]),
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
    model_input = task_spec(config["task"]).model_input(config)
    plan = Plan(config, tuple(notices), origins, labels, geometry=geometry, model_input=model_input)
    untiled = {}
    footprints = {}
    predicted = set(plan.predict_scenes)
    for name, scene in config["scenes"].items():
        striped, raster = _check_scene(plan, name, scene, default_bands, say)
        if striped:
            untiled[name] = tuple(striped)
        if raster is not None and name in predicted:
            footprints[name] = footprint_of(raster)
    inputs = {path: file_stat(Path(workdir) / path) for path in checked_files(config)}
    plan = replace(plan, untiled=untiled, inputs=inputs, footprints=footprints)
    if plan.has_project():
        check_project_crs(plan)
        if config["project"]["seams"]:
            plan = replace(plan, seams=tuple(find_seams(footprints, int(config["tiling"]["overlap"]))))
    plan = replace(plan, batches=_batches(plan, workdir))
    for line in plan.striped_warnings():
        say(line)
    return plan


def _silent(line: str) -> None:
    pass


def footprint_of(raster: RasterInfo) -> Footprint:
    """A scene's footprint from its header: CRS (its EPSG code where it has one), bounds, pixel size."""
    t = raster.transform
    xs, ys = (t.c, t.c + t.a * raster.width), (t.f, t.f + t.e * raster.height)
    crs = raster.crs.to_string() if raster.crs is not None else ""
    dtype = raster.dtypes[0] if raster.dtypes else ""
    return Footprint(crs, (min(xs), min(ys), max(xs), max(ys)), (abs(t.a), abs(t.e)), raster.count, dtype)


def check_project_crs(plan: Plan) -> None:
    """The project's layers need one CRS: the scenes' own, or project.crs (one line naming both otherwise)."""
    by_crs: dict[str, list[str]] = {}
    for name, footprint in plan.footprints.items():
        by_crs.setdefault(footprint.crs, []).append(name)
    listed = "; ".join(f"{crs}: {_some(names)}" for crs, names in by_crs.items())
    crs = plan.config["project"]["crs"]
    if crs:
        try:
            CRS.from_user_input(crs)
        except CRSError as err:
            raise ConfigError(f"project.crs: {crs!r} is not a CRS ({err})") from err
    if len(by_crs) > 1 and not crs:
        raise ConfigError(
            f"predict.scenes: the scenes are in {len(by_crs)} CRSs ({listed}); set project.crs to the CRS of the "
            "project's layers (e.g. project: {crs: EPSG:32618})"
        )


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _batches(plan: Plan, workdir: str | Path) -> tuple[PredictionBatch, ...]:
    """The prediction batches: the recorded ones that still hold, then the new scenes and seams."""
    members = plan.project_sources() if plan.has_project() else plan.predict_scenes
    size = int(plan.config["predict"]["scenes_per_job"])
    base = Path(workdir)
    batches = form_batches(members, plan.batch_entry, size, read_recorded(workdir), lambda r: (base / r).exists())
    return tuple(PredictionBatch(number, scenes) for number, scenes in batches.items())


def _check_scene(
    plan: Plan, name: str, scene: Mapping[str, Any], default_bands: set[str], say: Callable[[str], None] = print
) -> tuple[list[str], RasterInfo | None]:
    """Header checks of one scene's existing inputs; its striped rasters (none when tiled or absent) and its
    header (none when absent)."""
    config = plan.config
    path = scene["path"]
    demo = name in config["demo"]["scenes"]
    if demo and path != plan.demo_raster(name):
        raise ConfigError(f"scenes.{name}: a demo scene's path must be {plan.demo_raster(name)}")
    if not is_remote(path) and not Path(path).exists():
        if demo:
            return [], None
        raise InputError(f"{path}: raster not found ({scene_key(name, 'path', plan.origins)})")
    try:
        raster = check_raster(path)
        bands = None if name in default_bands else scene.get("bands")
        check_imagery(raster, bands, scene.get("scale"), f"scenes.{name}", plan.model_input.raw)
        if name in plan.predict_scenes:
            check_scene_input(plan, name, scene, say)
        if name in config["train"]["scenes"] and not config["model"]["file"]:
            tiling, train = config["tiling"], config["train"]
            check_validation_band(raster, name, tiling["patch_size"], tiling["overlap"], train["validation_fraction"])
        striped = striped_sources(path)
        check_tiled(path, striped)
        tops = scene.get("tree_tops")
        if tops and not demo and not is_remote(tops) and not Path(tops).exists():
            raise InputError(f"{tops}: tree tops not found (scenes.{name}.tree_tops)")
        annotations = scene.get("annotations")
        if annotations and (Path(annotations).exists() or not demo):
            image_name = plan.scene_image_name(name)
            column = scene.get("label_column")
            warnings = plan.task.check_annotations(annotations, raster, list(plan.labels), column, image_name)
            for key, line in warnings or ():
                if not scene.get(key):
                    say(line.replace("{scene}", name))
    except InputError as err:
        if name in plan.origins:
            raise InputError(f"{err} ({plan.origins[name]})") from err
        raise
    return striped, raster


def check_scene_input(plan: Plan, name: str, scene: Mapping[str, Any], say: Callable[[str], None]) -> None:
    """A predicted scene's bands against the model's: as many, and ``normalize`` only on training scenes (the
    model's statistics are used); a scene whose statistics differ wildly from a raw model file's gets a warning."""
    model = plan.model_input
    count = len(scene.get("bands") or DEFAULT_BANDS)
    source = plan.config["model"]["file"] or "the model"
    if count != model.count:
        raise InputError(
            f"{scene['path']}: scenes.{name}.bands gives {count} band(s) but {source} takes {model.count} "
            f"[{', '.join(model.names)}]; set scenes.{name}.bands to {model.count} bands"
        )
    if scene.get("normalize") is not None and name not in plan.train_scenes:
        raise ConfigError(
            f"config: key 'scenes.{name}.normalize' is set on a scene that is only predicted: the model's own "
            f"statistics are used ({model.describe()}); normalize: auto computes them from training scenes (set it on "
            "those, or model.normalize)"
        )
    if model.raw and not model.pending and plan.config["model"]["file"] and not is_remote(scene["path"]):
        spec = ImageSpec(tuple(scene.get("bands") or DEFAULT_BANDS), *mask_of(check_raster(scene["path"])), raw=True)
        difference = differs_wildly(band_statistics(scene["path"], spec, f"scenes.{name}", STATISTICS_SIDE), model)
        if difference:
            say(
                f"{scene['path']}: scene {name}'s pixels differ from what the model was trained on ({difference}): "
                "another sensor or bit depth?"
            )


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
    for path in (config["model"]["file"], config["train"]["init"], config["model"]["backbone_weights"]):
        if path:
            yield str(path)


def file_stat(path: str | Path) -> tuple[int, int] | None:
    """A file's (size, mtime_ns), None when it does not exist."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_size, stat.st_mtime_ns)


KEPT_PLANS = 8  # stored plans kept (the newest): one per config a working folder ran with lately


def store_plan(plan: Plan, key: str, workdir: str | Path = ".") -> Path:
    """Write the plan atomically under ``.snakemake/rasterscale/plan-{key}.json``, and remove all but the newest
    :data:`KEPT_PLANS` stored plans (a job that finds its plan gone builds it again); its path."""
    path = Path(workdir) / paths.stored_plan(key)
    with atomic_path(path) as tmp:
        tmp.write_text(plan.to_json())
    stored = sorted(path.parent.glob("plan-*.json"), key=_mtime, reverse=True)
    for old in stored[KEPT_PLANS:]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def load_plan(key: str, workdir: str | Path = ".") -> Plan | None:
    """The plan stored under ``key``, or None when there is none, it is unreadable or of another format, or a
    file its checks read changed since (size or mtime; one absent then is the workflow's to make)."""
    path = Path(workdir) / paths.stored_plan(key)
    try:
        plan = Plan.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    base = Path(workdir)
    # a file absent when the plan was built is one the workflow makes (a demo scene): its appearing changes nothing
    if any(stat is not None and file_stat(base / name) != stat for name, stat in plan.inputs.items()):
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
