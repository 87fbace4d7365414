"""The workflow's plan, as the rules read it: :class:`Plan` holds the validated config and what the dry run's checks
found (:func:`rasterscale.workflow.checks.build_plan` makes it), and answers every query the rules and the jobs'
files need: the scenes' files, the batches, the project, the model files, the final targets. Paths come from
:mod:`rasterscale.jobs.paths`, job inputs from :mod:`rasterscale.jobs.files`.

The plan is built once per invocation by the main Snakemake process and stored
(:mod:`rasterscale.workflow.storage`); a job's re-parse loads it. The three modules split the plan by what they
do: queries (here), checks (:mod:`~rasterscale.workflow.checks`), storage (:mod:`~rasterscale.workflow.storage`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rasterscale.config.schema import nothing_to_do
from rasterscale.grid.partitions import Neighbourhood
from rasterscale.grid.project import Footprint, Seam, is_seam
from rasterscale.jobs import paths
from rasterscale.jobs.files import PredictionBatch
from rasterscale.jobs.paths import RunPaths
from rasterscale.raster.bands import InputBands
from rasterscale.raster.item_header import ItemHeader
from rasterscale.raster.remote import file_name, local_files
from rasterscale.runtime.cores import planned_workers
from rasterscale.runtime.preflight import Geometry
from rasterscale.scene import Imagery, Scene
from rasterscale.settings import RunSettings, SceneSettings, Settings, settings_of
from rasterscale.tasks.registry import task_spec
from rasterscale.tasks.spec import TaskSpec
from rasterscale.workflow import partitions

SECTIONS = ("train", "predict")
ENTRIES_KEPT = 4  # batches whose entries a plan keeps built (Plan.prediction_batch)


@dataclass(frozen=True)
class Plan:
    """The validated config and what its checks found, and everything the rules derive from them."""

    config: dict[str, Any]
    notices: tuple[str, ...] = ()  # warnings: renamed keys, scenes scored on their training data
    origins: dict[str, str] = field(default_factory=dict)  # scene -> its scene table's file and line
    labels: tuple[str, ...] = ()  # the effective class names (config keys over the model file's)
    untiled: dict[str, tuple[str, ...]] = field(default_factory=dict)  # scene -> its striped rasters
    geometry: dict[str, Geometry] = field(default_factory=dict)  # section -> launch geometry
    members: dict[int, tuple[str, ...]] = field(default_factory=dict)  # batch -> its scenes and seams, by name
    # a kept batch's members that the config no longer names (their rasters still there): their recorded entries;
    # every other member's entry is the plan's (batch_entry), built when its batch is asked for
    kept: dict[str, Scene] = field(default_factory=dict)
    inputs: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # file -> (size, mtime_ns) checked
    footprints: dict[str, Footprint] = field(default_factory=dict)  # predicted scene -> its header's footprint
    seams: tuple[Seam, ...] = ()  # between the predicted scenes
    model_input: InputBands = field(default_factory=InputBands)  # the model's bands (config keys over its file's)
    # scene -> the header its STAC item gave, which the plan trusted (its tile-manifest job compares); scene -> why
    # it was left out (scenes_on_error: skip). Both the main process's only: a job's re-parse needs neither.
    trusted: dict[str, ItemHeader] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    # a batch's plan (rasterscale.workflow.storage.plan_of_batch), what the jobs of batch ``scope`` read: its members,
    # their scenes and seams, the training scenes, and its partition's neighbourhood (``neighbourhoods``)
    # ``predict.scenes`` of its config lists its own only, ``predicted`` counts the whole plan's
    scope: int | None = None
    neighbourhoods: dict[int, Neighbourhood] | None = None
    predicted: int | None = None
    # the first path its checks read that no stat watches (a remote file, a VRT): the main process then builds the
    # plan every time (rasterscale.workflow.reuse); "" when none
    unwatched: str = ""

    # -- the config -------------------------------------------------------------------------------------------

    @functools.cached_property
    def settings(self) -> Settings:
        """The validated config, typed (:mod:`rasterscale.settings`)."""
        return settings_of(self.config)

    def with_(self, **changes: Any) -> Plan:
        """The plan with these fields changed (:func:`dataclasses.replace`), its settings kept as built (the
        config does not change; settings_of over 10,000 scenes takes 0.16 s)."""
        changed = dataclasses.replace(self, **changes)
        changed.__dict__["settings"] = self.settings  # functools.cached_property's own slot
        return changed

    @property
    def run(self) -> str:
        """The run's name, which keys its outputs (results/{run}/): the model's (model.name)."""
        return str(self.settings.model.name)

    @functools.cached_property
    def paths(self) -> RunPaths:
        """The paths of this run's outputs."""
        return RunPaths(self.run)

    @property
    def task(self) -> TaskSpec:
        return task_spec(self.settings.task)

    @property
    def scenes(self) -> dict[str, SceneSettings]:
        return self.settings.scenes

    @property
    def train_scenes(self) -> list[str]:
        return list(self.settings.train.scenes)

    @property
    def predict_scenes(self) -> list[str]:
        return list(self.settings.predict.scenes)

    def is_predicted(self, name: str) -> bool:
        """Whether predict.scenes names this scene (a set's lookup: the rules ask once a batch or a scene, and a
        list's `in` over 200,000 scenes each time would make the plan quadratic)."""
        return name in self._predicted_set

    @functools.cached_property
    def _predicted_set(self) -> frozenset[str]:
        return frozenset(self.settings.predict.scenes)

    @property
    def trains(self) -> bool:
        """Whether the run trains its model: it has training scenes and no model.file."""
        return bool(self.train_scenes) and not self.settings.model.file

    def section(self, name: str) -> RunSettings:
        """A DDP section's settings by name ("train" or "predict")."""
        return self.settings.ddp_section(name)

    def world_size(self, section: str) -> int:
        """Ranks of one job of a DDP section (for prediction: of one shard)."""
        return self.geometry[section].world_size

    @property
    def shards(self) -> int:
        return self.geometry["predict"].shards

    def rank_threads(self, section: str) -> int:
        values = self.section(section)
        return values.devices * (planned_workers(values.workers) + 1)

    def nothing_to_do(self) -> str | None:
        return nothing_to_do(self.config)

    # -- scenes -----------------------------------------------------------------------------------------------

    def scene_source(self, name: str) -> str:
        """The raster the config names for a scene."""
        return self.scenes[name].path

    def scene_raster(self, name: str) -> str:
        """The raster a scene is read from: its own, or the tiled COG made from it when its own is striped; a
        seam's mosaic of its scenes' rasters."""
        if is_seam(name):
            return self.paths.seam_mosaic(name)
        return self.paths.cog_raster(name) if name in self.untiled else self.scene_source(name)

    def raster_inputs(self, *names: str) -> list[str]:
        """The rasters of these scenes as a rule's inputs: the local ones (a remote raster is no file Snakemake
        could wait for; the job reads it by its URL from its job file or params)."""
        return local_files(self.scene_raster(name) for name in names)

    def scene_annotations(self, name: str) -> str:
        return self.scenes[name].annotations or ""

    def scene_tree_tops(self, name: str) -> str:
        """A scene's true tree tops (scenes.X.tree_tops), which a height model's tops are scored against."""
        return self.scenes[name].tree_tops or ""

    def scene_image_name(self, name: str) -> str:
        """The image name a scene's CSV/VOC annotations give its boxes under (scenes.X.image_path)."""
        return self.scenes[name].image_path or file_name(self.scene_source(name))

    def scene_imagery(self, name: str) -> Imagery:
        """The scene's imagery keys (bands, scale) for its manifest's imagery spec (a seam's: its first scene's)."""
        if is_seam(name):
            name = self.seam(name).a
        scene = self.scenes[name]
        bands = list(scene.bands) if scene.bands is not None else None
        scale = dict(scene.scale) if scene.scale is not None else None
        return Imagery(f"scenes.{name}", bands, scale, self.model_input.raw)

    def scene_outputs(self, name: str) -> dict[str, str]:
        """A scene's merged outputs (the task's, and the gathered profile), by the merge's keys."""
        folder = self.paths.scene_dir(name)
        return {key: f"{folder}/{file}" for key, file in self._scene_output_names.items()}

    @functools.cached_property
    def _scene_output_names(self) -> dict[str, str]:
        """A scene's merged outputs' file names by the merge's keys (asked for a million times at 100,000 scenes)."""
        names = dict(self.task.scene_outputs(self.settings))
        names["profile"] = paths.SCENE_PROFILE
        return names

    def demo_raster(self, name: str) -> str:
        return paths.demo_raster(self.settings.demo.directory, name)

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
        """The scenes no batch makes the manifest of (training-only scenes: rule tiles)."""
        return [name for name in self.scenes if not self.is_predicted(name)]

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
                f"COG {self.paths.cog_raster(name)} (rule cog)"
            )
        return warnings

    # -- prediction -------------------------------------------------------------------------------------------

    def rank_files(self, name: str, batch: int) -> list[str]:
        """A scene's rank files (paths without suffix), every shard's, in rank order."""
        return self.paths.rank_files(name, batch, self.shards, self.world_size("predict"))

    @functools.cached_property
    def _seams_by_name(self) -> dict[str, Seam]:
        return {seam.name: seam for seam in self.seams}

    def seam(self, name: str) -> Seam:
        return self._seams_by_name[name]

    def seams_named(self, names: Iterable[str]) -> list[Seam]:
        """The plan's seams among these names (a kept batch may hold a seam the plan no longer has)."""
        found = self._seams_by_name
        return [found[name] for name in names if name in found]

    def batch_entry(self, name: str, batch: int) -> Scene:
        """A scene's (or seam's) entry in a batch's job file: raster, manifest, imagery keys, rank files, outputs;
        a seam's mosaicked rasters and core."""
        return Scene(
            name=name,
            raster=self.scene_raster(name),
            manifest=self.paths.scene_manifest(name),
            imagery=self.scene_imagery(name),
            rank_files=tuple(self.rank_files(name, batch)),
            outputs=self.scene_outputs(name),
            mosaic=self._mosaic(name),
            core=self.seam(name).core if is_seam(name) else "",
        )

    def _mosaic(self, name: str) -> tuple[str, ...]:
        """The rasters a seam's mosaic reads (a scene's: none)."""
        if not is_seam(name):
            return ()
        seam = self.seam(name)
        return (self.scene_raster(seam.a), self.scene_raster(seam.b))

    @property
    def batch_numbers(self) -> list[int]:
        return list(self.members)

    def prediction_batch(self, batch: int) -> PredictionBatch:
        """A batch with its members' entries (raster, manifest, imagery keys, rank files, outputs), built the first
        time it is asked for: a plan stores its batches' members by name (a job's re-parse builds its batch's
        entries only, not 200,000 of them)."""
        cache = self._entries
        if batch in cache:
            cache.move_to_end(batch)
            return cache[batch]
        entries = tuple(
            self.kept[name] if name in self.kept else self.batch_entry(name, batch) for name in self.members[batch]
        )
        cache[batch] = PredictionBatch(batch, entries)
        if len(cache) > ENTRIES_KEPT:
            cache.popitem(last=False)
        return cache[batch]

    @functools.cached_property
    def _entries(self) -> OrderedDict[int, PredictionBatch]:
        """The batches whose entries were asked for last (their job files are written one batch after the other):
        every batch's at once would be about 4 kB a scene, 800 MB at 200,000 scenes."""
        return OrderedDict()

    @property
    def batches(self) -> tuple[PredictionBatch, ...]:
        """Every batch with its entries (:meth:`prediction_batch`)."""
        return tuple(self.prediction_batch(number) for number in self.members)

    def batch_inputs(self, batch: int) -> dict[str, list[str]]:
        """The rasters a batch's scenes and seams read, their manifests, and the seams' mosaics."""
        rasters: list[str] = []
        manifests: list[str] = []
        mosaics: list[str] = []
        for name in self.members[batch]:  # their files, without building their entries (rank files, imagery keys)
            kept = self.kept.get(name)
            raster = kept.raster if kept else self.scene_raster(name)
            mosaic = kept.mosaic if kept else self._mosaic(name)
            rasters += mosaic or (raster,)
            manifests.append(kept.manifest if kept else self.paths.scene_manifest(name))
            mosaics += [raster] if mosaic else []
        return {"rasters": list(dict.fromkeys(local_files(rasters))), "manifests": manifests, "mosaics": mosaics}

    def batch_outputs(self, batch: int) -> list[str]:
        """A batch's merge job's scene outputs: its scenes' and seams' merged files (its record, the rule's other
        output, is ``self.paths.batch_record("merge", batch)``)."""
        kept = self.kept
        outputs = (kept[name].outputs if name in kept else self.scene_outputs(name) for name in self.members[batch])
        return [path for files in outputs for path in files.values()]

    @functools.cached_property
    def partition_neighbourhoods(self) -> dict[int, Neighbourhood]:
        """Each partition's sources and neighbours (:func:`rasterscale.workflow.partitions.partition_neighbourhoods`),
        computed once a plan (every partition's job and rule asks); a batch's plan carries its own."""
        if self.neighbourhoods is not None:
            return self.neighbourhoods
        return partitions.partition_neighbourhoods(self)

    def batches_of(self, names: Iterable[str]) -> list[int]:
        """The batches holding any of these scenes or seams, by number."""
        index = self._member_batches
        return sorted({number for name in names for number in index.get(name, ())})

    @functools.cached_property
    def _member_batches(self) -> dict[str, list[int]]:
        """Each member's batches: a query a batch (its partition's inputs) would otherwise go through every batch's
        members, quadratic in the scenes."""
        index: dict[str, list[int]] = {}
        for number, names in self.members.items():
            for name in names:
                index.setdefault(name, []).append(number)
        return index

    def batch_records(self, step: str, names: Iterable[str]) -> list[str]:
        """The records of the batch step ``step`` (its name) of the batches holding any of these scenes or seams:
        what a job that reads their files depends on (:mod:`rasterscale.workflow.batches`)."""
        return [self.paths.batch_record(step, batch) for batch in self.batches_of(names)]

    def predicted_batches(self) -> list[int]:
        """The batches holding predicted scenes, or seams between them (a batch of seams too)."""
        return self.batches_of([*self.predict_scenes, *(seam.name for seam in self.seams)])

    # -- the project ------------------------------------------------------------------------------------------

    def has_project(self) -> bool:
        """Whether the run writes the project's layers: it predicts several scenes."""
        return self.predicted_count > 1

    @property
    def predicted_count(self) -> int:
        """How many scenes the run predicts (a batch's plan: the whole plan's count)."""
        return len(self.settings.predict.scenes) if self.predicted is None else self.predicted

    def project_sources(self) -> list[str]:
        """The scenes and seams whose layers make the project's, by name (the config's order changes nothing)."""
        return [*sorted(self.predict_scenes), *(seam.name for seam in self.seams)]

    def project_crs(self) -> str:
        """project.crs, else the predicted scenes' one CRS (checked when the plan is built)."""
        return self._project_crs

    @functools.cached_property
    def _project_crs(self) -> str:  # once: every partition's job asks, and it goes through every footprint
        crs = {footprint.crs for footprint in self.footprints.values()}
        return str(self.settings.project.crs or (crs.pop() if len(crs) == 1 else ""))

    def prediction_model(self) -> str:
        """The model file prediction reads: model.file, or the one training writes."""
        model = self.settings.model
        return str(model.file or paths.trained_model(str(model.name)))

    # -- training and evaluation ------------------------------------------------------------------------------

    def truth_scene(self, name: str, outputs: dict[str, str] | None = None) -> Scene:
        """A scene with its ground truth (training, scoring): raster, manifest, annotations, image name, tree tops,
        and ``outputs`` (its merged layers, to score); without annotations, no label column nor image name."""
        annotations = self.scene_annotations(name)
        return Scene(
            name=name,
            raster=self.scene_raster(name),
            manifest=self.paths.scene_manifest(name),
            annotations=annotations,
            label_column=self.scenes[name].label_column if annotations else None,
            image_path=self.scene_image_name(name) if annotations else None,
            outputs=outputs or {},
            tree_tops=self.scene_tree_tops(name),
        )
