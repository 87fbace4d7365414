"""A rank's points of one scene (:class:`~rasterscale.tasks.detectors.rankoutput.ObjectsRankOutput`'s GeoParquet
file and parts): each batch's heatmaps decoded on the device in one call (:func:`~.decode.decode_peaks`), copied
to the host as one tensor, and each tile's points kept where its core holds them (the dense tasks' core rule:
:func:`~rasterscale.tasks.blending.tile_cores`), so that the tiles of a scene give each place's point once."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import geopandas as gpd
import numpy as np
import torch
from rasterio.windows import Window

from rasterscale.atomic import write_geoparquet
from rasterscale.grid.tile import Tile
from rasterscale.tasks.api import PredictScene
from rasterscale.tasks.detectors.rankoutput import ObjectsRankOutput
from rasterscale.tasks.points.decode import decode_peaks
from rasterscale.tasks.points.layer import POINT_COLUMNS, empty_points, in_cores, points_frame
from rasterscale.tasks.points.modelfiles import PeakRule
from rasterscale.tasks.spec import Part


class PointsRankOutput(ObjectsRankOutput):
    """A rank's points of one scene: ``rule`` how its heatmaps' peaks are decoded, ``cores`` every tile's core."""

    unit = "points"

    def __init__(
        self,
        scene: PredictScene,
        labels: Sequence[str],
        path: str | Path,
        parts: Sequence[Part],
        rule: PeakRule,
        cores: Mapping[int, Window],
    ) -> None:
        super().__init__(scene, labels, path, parts)
        self.rule, self.cores = rule, cores

    @staticmethod
    def write_file(frame: gpd.GeoDataFrame, path: str | Path, /) -> None:
        write_geoparquet(frame[POINT_COLUMNS].reset_index(drop=True), path)

    @staticmethod
    def empty(crs: Any, /) -> gpd.GeoDataFrame:
        return empty_points(crs)

    def add_batch(self, tiles: Sequence[Tile], result: torch.Tensor) -> None:
        """The batch's heatmaps (B, K, H, W) decoded on the device, copied to the host once, and its tiles' points
        kept by their cores in one pass."""
        points = decode_peaks(result, self.rule.window, self.rule.threshold, self.rule.top_k)
        started = time.perf_counter()
        found = points.cpu().numpy()
        self.d2h_s += time.perf_counter() - started
        self.results.append(([tile.tile_id for tile in tiles], in_cores(found, tiles, self.cores)))

    def frame(self) -> gpd.GeoDataFrame:
        rows = [found for _, found in self.results if len(found)]
        stacked = np.concatenate(rows) if rows else np.zeros((0, 5))
        return points_frame(stacked, self.labels, self.scene.transform, self.scene.crs)

    def held_tile_ids(self) -> list[int]:
        return [tile_id for tile_ids, _ in self.results for tile_id in tile_ids]
