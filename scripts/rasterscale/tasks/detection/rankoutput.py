"""Detection's rank output: a rank's detections of one scene, as one GeoParquet file (boxes in raster pixels and CRS
polygons, :mod:`rasterscale.tasks.detectors.rankoutput`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import geopandas as gpd
import numpy as np
import pandas as pd

from rasterscale.grid.tile import Tile
from rasterscale.raster.geo import pixel_boxes_to_polygons
from rasterscale.tasks.detection.batched import BatchDetections
from rasterscale.tasks.detection.merge import empty_detections, write_detections_file
from rasterscale.tasks.detectors.batching import tile_rows
from rasterscale.tasks.detectors.rankoutput import TileByTileRankOutput


@dataclass
class TileDetections:
    boxes: np.ndarray  # tile pixels
    scores: np.ndarray
    labels: np.ndarray


def detections_to_host(found: BatchDetections) -> list[TileDetections]:
    """A batch's detections (one tensor per kind on the device) on the host, in one copy, as each tile's."""
    host = found.packed().cpu().numpy()
    runs = tile_rows(host[:, 6], found.count)
    return [TileDetections(host[a:b, :4], host[a:b, 4], host[a:b, 5].astype(np.int64)) for a, b in runs]


def detections_frame(
    tiles: Sequence[tuple[Tile, TileDetections]], labels: Sequence[str], transform: Any, crs: Any
) -> gpd.GeoDataFrame:
    """Tile-pixel detections to raster pixels and CRS polygons, one row per box."""
    rows = [(tile, d) for tile, d in tiles if len(d.boxes)]
    if not rows:
        return empty_detections(crs)
    boxes = np.concatenate([d.boxes.astype(np.float64) + [t.col_off, t.row_off, t.col_off, t.row_off] for t, d in rows])
    frame = pd.DataFrame(
        {
            "tile_id": np.concatenate([np.full(len(d.boxes), t.tile_id, dtype=np.int64) for t, d in rows]),
            "label": np.asarray(labels, dtype=object)[np.concatenate([d.labels for _, d in rows])],
            "score": np.concatenate([d.scores for _, d in rows]).astype(np.float32),
            "px_xmin": boxes[:, 0],
            "px_ymin": boxes[:, 1],
            "px_xmax": boxes[:, 2],
            "px_ymax": boxes[:, 3],
        }
    )
    return gpd.GeoDataFrame(frame, geometry=pixel_boxes_to_polygons(boxes, transform), crs=crs)


class DetectionRankOutput(TileByTileRankOutput):
    """A rank's detections of one scene, as GeoParquet (boxes in raster pixels and CRS polygons)."""

    unit = "detections"
    write_file = staticmethod(write_detections_file)
    empty = staticmethod(empty_detections)

    to_host = staticmethod(detections_to_host)

    def add(self, tile: Tile, result: TileDetections) -> None:
        """One tile's detections, on the host."""
        self.results.append((tile, result))

    def frame(self) -> gpd.GeoDataFrame:
        return detections_frame(self.results, self.labels, self.scene.transform, self.scene.crs)

    def held_tile_ids(self) -> list[int]:
        return [tile.tile_id for tile, _ in self.results]
