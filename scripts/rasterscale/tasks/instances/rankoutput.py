"""Instances' rank output: a rank's crown polygons of one scene, as one GeoParquet file (:mod:`.polygons`).

Each tile's masks become polygons as the tile is added (:func:`~.polygons.tile_instances`) and the masks are let
go, so a rank holds polygons only, and only those not in a part yet: a part is written every
``predict.save_every`` seconds, or sooner when the polygons held reach
:data:`rasterscale.jobs.resume.MAX_UNSAVED_BYTES` (:meth:`InstanceRankOutput.unsaved_bytes`). Its memory
is flat in the scene's size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import geopandas as gpd
import numpy as np

from rasterscale.grid.tile import Tile
from rasterscale.tasks.api import PredictScene
from rasterscale.tasks.detectors.rankoutput import TileByTileRankOutput
from rasterscale.tasks.instances.model import instances_to_host
from rasterscale.tasks.instances.polygons import (
    empty_instances,
    instances_frame,
    tile_instances,
    write_instances_file,
)
from rasterscale.tasks.spec import Part


class InstanceRankOutput(TileByTileRankOutput):
    """A rank's instances of one scene: the parts' rows, then those of the tiles added since, in prediction
    order. A part holds the instances of the tiles added since the previous one.

    ``add`` takes a tile's result as numpy arrays: ``boxes`` (N, 4), ``scores`` (N,), ``labels`` (N,), 0-based
    indexes into ``labels``, and ``masks`` (N, H, W) (bool, 0/1, or probabilities in [0, 1] kept above
    ``mask_threshold``; a model's (N, 1, H, W) as well), at the tile's pixels or, with ``origins`` (N, 2: column,
    row), each the crop of the tile from its origin. The model's boxes are not kept: an instance's box is its
    polygon's."""

    unit = "instances"
    write_file = staticmethod(write_instances_file)
    empty = staticmethod(empty_instances)

    def __init__(
        self,
        scene: PredictScene,
        labels: Sequence[str],
        path: str | Path,
        parts: Sequence[Part] = (),
        mask_threshold: float = 0.5,
    ) -> None:
        super().__init__(scene, labels, path, parts)
        self.mask_threshold = mask_threshold
        self.held = 0  # the held tiles' polygons' bytes, about

    @classmethod
    def of_model(cls, scene: PredictScene, model_cfg: Any, path: str | Path, parts: Sequence[Part]) -> Self:
        """The output of a model of ``model_cfg`` (an :class:`~.modelfiles.InstanceConfig`): its labels and mask
        threshold."""
        return cls(scene, model_cfg.labels, path, parts, model_cfg.mask_threshold)

    to_host = staticmethod(instances_to_host)

    def add(self, tile: Tile, result: Mapping[str, np.ndarray]) -> None:
        """One tile's instances, on the host."""
        found = tile_instances(
            result["masks"],
            result["scores"],
            result["labels"],
            tile,
            self.scene.width,
            self.scene.height,
            self.mask_threshold,
            result.get("origins"),
        )
        self.results.append(found)
        self.held += found.nbytes()

    def unsaved_bytes(self) -> int:
        return self.held

    def frame(self) -> gpd.GeoDataFrame:
        return instances_frame(self.results, self.labels, self.scene.transform, self.scene.crs)

    def held_tile_ids(self) -> list[int]:
        return [found.tile_id for found in self.results]

    def forget_held(self) -> None:
        self.results, self.held = [], 0
