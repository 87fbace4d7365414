"""A rank's objects of one scene as one GeoParquet file, what the tasks that find objects share of their rank
outputs (:class:`~rasterscale.tasks.api.RankOutput`): the parts' rows, then those of the tiles added since. Each
task's ``rankoutput`` says how a tile's result is held and becomes rows."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import geopandas as gpd
import pandas as pd

from rasterscale.grid.tile import Tile
from rasterscale.tasks.api import PredictScene, RankOutput
from rasterscale.tasks.spec import Part


class ObjectsRankOutput(RankOutput):
    """A rank's objects of one scene, as one GeoParquet file: the parts' rows, then those of the tiles added since,
    in prediction order. A part holds the objects of the tiles added since the previous one. A task says how a
    batch's result is held (:meth:`add_batch`, its copies to the host counted in ``d2h_s``), how the held tiles
    become a frame (:meth:`frame`) and which ids they have (:meth:`held_tile_ids`)."""

    unit: ClassVar[str]  # what the log counts ("detections")

    @staticmethod
    @abstractmethod
    def write_file(frame: gpd.GeoDataFrame, path: str | Path, /) -> None:
        """A frame to a rank file, atomically."""

    @staticmethod
    @abstractmethod
    def empty(crs: Any, /) -> gpd.GeoDataFrame:
        """The frame of no objects, in ``crs``."""

    def __init__(self, scene: PredictScene, labels: Sequence[str], path: str | Path, parts: Sequence[Part] = ()):
        self.scene, self.labels, self.path = scene, list(labels), Path(path)
        self.parts = list(parts)
        self.results: list[Any] = []  # tiles added and not in a part yet
        self.d2h_s = 0.0

    def stage_seconds(self) -> dict[str, float]:
        return {"d2h": self.d2h_s}

    @classmethod
    def of_model(cls, scene: PredictScene, model_cfg: Any, path: str | Path, parts: Sequence[Part]) -> Self:
        """The output of a model of ``model_cfg`` (its task's configuration: its labels, and what else the output
        needs of it)."""
        return cls(scene, model_cfg.labels, path, parts)

    @abstractmethod
    def frame(self) -> gpd.GeoDataFrame:
        """The objects of the tiles held, in the rank file's columns."""

    @abstractmethod
    def held_tile_ids(self) -> list[int]:
        """The ids of the tiles held, in the order added."""

    def forget_held(self) -> None:
        self.results = []

    def save_part(self, path: Path) -> Part | None:
        if not self.results:
            return None
        self.write_file(self.frame(), path)
        part = Part(path, self.held_tile_ids())
        self.parts.append(part)
        self.forget_held()
        return part

    def write(self) -> str:
        frames = [gpd.read_parquet(part.path) for part in self.parts] + [self.frame()]
        frames = [frame for frame in frames if len(frame)]
        frame = pd.concat(frames, ignore_index=True) if frames else self.empty(self.scene.crs)
        self.write_file(frame, self.path)
        resumed = f" ({len(self.parts)} part(s))" if self.parts else ""
        return f"{len(frame)} {self.unit}{resumed}"


class TileByTileRankOutput(ObjectsRankOutput):
    """Objects whose batch is copied to the host once (:meth:`to_host`) and then held tile by tile (:meth:`add`):
    detections and instances, whose tiles' objects become rows on their own."""

    @staticmethod
    @abstractmethod
    def to_host(result: Any, /) -> list[Any]:
        """A batch's result (on the device) as each tile's, on the host (what :meth:`add` takes)."""

    @abstractmethod
    def add(self, tile: Tile, result: Any) -> None:
        """One tile's result, on the host."""

    def add_batch(self, tiles: Sequence[Tile], result: Any) -> None:
        """The batch's objects, copied to the host once (:meth:`to_host`), then tile by tile."""
        started = time.perf_counter()
        found = self.to_host(result)
        self.d2h_s += time.perf_counter() - started
        for tile, one in zip(tiles, found, strict=True):
            self.add(tile, one)
