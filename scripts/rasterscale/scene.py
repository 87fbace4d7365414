"""A scene as the workflow hands it to its jobs: the raster it is read from, its tile manifest, its imagery keys,
its ground truth, its rank files and merged outputs (:class:`Scene`). One shape for every job: the plan writes it
into the job files (:mod:`rasterscale.jobs.files`), training, prediction, merge and evaluation read it; and a
source of the project's layers (a scene or a seam) as the project's merge reads it (:class:`ProjectSource`). No
torch, and of the package only the settings: every layer may use it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rasterscale.settings import Settings


@dataclass(frozen=True)
class Imagery:
    """A scene's imagery keys for its manifest's imagery spec: its config key, bands and scale (None: defaults), and
    whether its model takes raw values (normalized by the model) rather than bands scaled to uint8."""

    key: str = "scene"
    bands: list[int] | None = None
    scale: dict[str, Any] | None = None
    raw: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "bands": self.bands, "scale": self.scale, "raw": self.raw}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Imagery:
        return cls(data.get("key", "scene"), data.get("bands"), data.get("scale"), bool(data.get("raw", False)))


# Scene's fields other than its outputs (the outputs are the other keys of its JSON entry)
_SCENE_FIELDS = (
    "name",
    "raster",
    "manifest",
    "imagery",
    "annotations",
    "label_column",
    "image_path",
    "rank_files",
    "mosaic",
    "core",
    "tree_tops",
)


@dataclass(frozen=True)
class Scene:
    """A scene as a job sees it: the raster it is read from, its tile manifest, and what the job at hand needs
    of the rest: its imagery keys (tile manifest), ground truth (training, evaluation), rank files (merge),
    merged outputs by key (merge, evaluation). A seam between two scenes (:mod:`rasterscale.grid.project`) is a
    scene whose raster is a mosaic of theirs (``mosaic``, written by its tile manifest job), whose tiles are those
    near its ``core`` (WKT in the raster's CRS), where the project keeps its objects."""

    name: str
    raster: str
    manifest: str
    imagery: Imagery | None = None
    annotations: str = ""
    label_column: str | None = None
    image_path: str | None = None  # the scene's image name in CSV/VOC annotations (detection)
    rank_files: tuple[str, ...] = ()
    outputs: dict[str, str] = field(default_factory=dict)
    mosaic: tuple[str, ...] = ()  # a seam's: the rasters its raster (a VRT) mosaics
    core: str = ""  # a seam's: where the project keeps its objects
    tree_tops: str = ""  # true tree tops (points) a height model's tops are scored against (regression)

    @property
    def rasters(self) -> tuple[str, ...]:
        """The rasters the scene is read from: a seam's mosaicked rasters, else its own."""
        return self.mosaic or (self.raster,)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON entry: name, raster, manifest, the other fields that are set, and the outputs as flat keys.
        Built once and shared (a batch's entries go into its tiles, predict and merge job files): not to be
        changed."""
        return self._entry

    @functools.cached_property
    def _entry(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "raster": self.raster, "manifest": self.manifest}
        if self.imagery is not None:
            data["imagery"] = self.imagery.to_dict()
        if self.annotations:
            data.update(annotations=self.annotations, label_column=self.label_column, image_path=self.image_path)
        if self.rank_files:
            data["rank_files"] = list(self.rank_files)
        if self.mosaic:
            data.update(mosaic=list(self.mosaic), core=self.core)
        if self.tree_tops:
            data["tree_tops"] = self.tree_tops
        return {**data, **self.outputs}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scene:
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
            mosaic=tuple(data.get("mosaic", ())),
            core=data.get("core", ""),
            tree_tops=data.get("tree_tops", ""),
        )


@dataclass(frozen=True)
class ProjectSource:
    """A source of the project's layers (a scene or a seam, :mod:`rasterscale.grid.project`) as the project's merge
    reads it: its name, CRS and area (a scene's footprint ``bounds``, a seam's ``core``, WKT; none for a scene whose
    header the plan did not read), and its merged layers by key (none where a partition needs only its area)."""

    name: str
    crs: str | None = None
    bounds: tuple[float, float, float, float] | None = None
    core: str = ""
    outputs: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON entry: name, CRS, core or bounds where known, and the layers as flat keys. Built once and
        shared (a source is listed by the partitions around it): not to be changed."""
        return self._entry

    @functools.cached_property
    def _entry(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name}
        if self.core:
            data.update(crs=self.crs, core=self.core)
        elif self.bounds is not None:
            data.update(crs=self.crs, bounds=list(self.bounds))
        return {**data, **self.outputs}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProjectSource:
        bounds = data.get("bounds")
        return cls(
            name=data["name"],
            crs=data.get("crs"),
            bounds=(bounds[0], bounds[1], bounds[2], bounds[3]) if bounds is not None else None,
            core=data.get("core", ""),
            outputs={key: value for key, value in data.items() if key not in ("name", "crs", "bounds", "core")},
        )


class ProjectJobFields(Protocol):
    """What a task's project merge reads of its job (:class:`rasterscale.jobs.files.ProjectJob` has these fields):
    the project's CRS and class names, its sources (their merged layers, CRS and areas), its outputs by key, its
    settings (task, merge, project); a partition's also the sources it keeps the objects of (``owners``) and the
    ``areas`` of its neighbours' neighbours (:mod:`rasterscale.grid.partitions`)."""

    @property
    def crs(self) -> str: ...
    @property
    def labels(self) -> tuple[str, ...]: ...
    @property
    def sources(self) -> tuple[ProjectSource, ...]: ...
    @property
    def outputs(self) -> dict[str, str]: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def owners(self) -> tuple[str, ...]: ...
    @property
    def areas(self) -> tuple[ProjectSource, ...]: ...
