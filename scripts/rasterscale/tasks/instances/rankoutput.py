"""Instances' rank output: a rank's crown polygons of one scene, as one GeoParquet file (:mod:`.polygons`).

Each tile's masks become polygons as the tile is added (:func:`~.polygons.tile_instances`) and the masks are let
go, so a rank holds polygons only, and only those not in a part yet: a part is written every
``predict.save_every`` seconds, or sooner when the polygons held reach
:data:`rasterscale.predict.tile_resume.MAX_UNSAVED_BYTES` (:meth:`InstanceRankOutput.unsaved_bytes`). Its memory
is flat in the scene's size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd

from rasterscale.grid.tile import Tile
from rasterscale.tasks.api import PredictScene, RankOutput
from rasterscale.tasks.instances.polygons import (
    TileInstances,
    empty_instances,
    instances_frame,
    tile_instances,
    write_instances_file,
)
from rasterscale.tasks.spec import Part


class InstanceRankOutput(RankOutput):
    """A rank's instances of one scene: the parts' rows, then those of the tiles added since, in prediction
    order. A part holds the instances of the tiles added since the previous one.

    ``add`` takes a tile's result as numpy arrays: ``boxes`` (N, 4), ``scores`` (N,), ``labels`` (N,), 0-based
    indexes into ``labels``, and ``masks`` (N, H, W) at the tile's pixels (bool, 0/1, or probabilities in [0, 1]
    kept above ``mask_threshold``; a model's (N, 1, H, W) as well). The model's boxes are not kept: an instance's
    box is its polygon's."""

    def __init__(
        self,
        scene: PredictScene,
        labels: Sequence[str],
        path: str | Path,
        parts: Sequence[Part] = (),
        mask_threshold: float = 0.5,
    ) -> None:
        self.scene, self.labels, self.path = scene, list(labels), Path(path)
        self.parts = list(parts)
        self.mask_threshold = mask_threshold
        self.results: list[TileInstances] = []  # tiles added and not in a part yet
        self.held = 0  # their polygons' bytes, about

    def add(self, tile: Tile, result: Mapping[str, np.ndarray]) -> None:
        found = tile_instances(
            result["masks"],
            result["scores"],
            result["labels"],
            tile,
            self.scene.width,
            self.scene.height,
            self.mask_threshold,
        )
        self.results.append(found)
        self.held += found.nbytes()

    def unsaved_bytes(self) -> int:
        return self.held

    def frame(self) -> gpd.GeoDataFrame:
        return instances_frame(self.results, self.labels, self.scene.transform, self.scene.crs)

    def save_part(self, path: Path) -> Part | None:
        if not self.results:
            return None
        write_instances_file(self.frame(), path)
        part = Part(path, [found.tile_id for found in self.results])
        self.parts.append(part)
        self.results, self.held = [], 0
        return part

    def write(self) -> str:
        frames = [gpd.read_parquet(part.path) for part in self.parts] + [self.frame()]
        frames = [frame for frame in frames if len(frame)]
        frame = pd.concat(frames, ignore_index=True) if frames else empty_instances(self.scene.crs)
        write_instances_file(frame, self.path)
        resumed = f" ({len(self.parts)} part(s))" if self.parts else ""
        return f"{len(frame)} instances{resumed}"
