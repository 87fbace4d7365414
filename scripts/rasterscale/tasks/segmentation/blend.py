"""Blending overlapping tile probabilities into one rank's class raster, with memory that does not grow with the
raster.

How the blend works (cores, halo tiles, edge weights, pieces finished as their last contributor comes, pieces
spilled to disk, blocks written as they complete, parts for resume) is shared with the other tasks that blend a
value per pixel: :mod:`rasterscale.tasks.blending`. Segmentation blends the tiles' softmax probabilities; a core's
class is the argmax of their weighted mean (:class:`TileBlender`), written into a
:class:`~rasterscale.tasks.segmentation.rankoutput.RankRaster` (with the probabilities as round(p * 255) when asked).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from affine import Affine
from rasterio.windows import Window

from rasterscale.grid.tile import Tile
from rasterscale.tasks.blender import BLEND_MB, Blender, SpilledChunks
from rasterscale.tasks.blending import (
    WEIGHT_FLOOR,
    BlendLayout,
    RasterSite,
    TilesByWindow,
    axis_cores,
    axis_weights,
    edge_weights,
    halo_tiles,
    spill_folder,
    tile_cores,
)
from rasterscale.tasks.segmentation.rankoutput import BLOCK_ROWS, RankRaster

__all__ = [
    "BLEND_MB",
    "WEIGHT_FLOOR",
    "SpilledChunks",
    "TileBlender",
    "TilesByWindow",
    "axis_cores",
    "axis_weights",
    "edge_weights",
    "halo_tiles",
    "spill_folder",
    "tile_cores",
]


class TileBlender(Blender):
    """One rank's blended class raster (:class:`~rasterscale.tasks.blending.Blender`): feed :meth:`add` every tile's
    softmax probabilities (C, h, w) in ``tiles_to_predict`` order, then :meth:`close`.

    The rank raster covers the bounding window of the own cores: band 1 the class ids (:data:`NODATA_CLASS`
    elsewhere), and with ``probabilities`` bands 2..C+1 the blended probabilities as round(p * 255) (band scale
    1/255).
    """

    raster: RankRaster
    finished_by_writer = True  # an argmax and the probabilities' bytes: several passes over the rows

    def __init__(
        self,
        tiles_to_predict: Iterable[Tile],
        own_ids: Iterable[int],
        cores: Mapping[int, Window],
        width: int,
        height: int,
        num_classes: int,
        taper: int,
        out_path: str | Path,
        transform: Affine,
        crs: object,
        probabilities: bool = False,
        block_rows: int = BLOCK_ROWS,
        parts: Sequence[str | Path] = (),
        keep_unsaved: bool = False,
        blend_mb: float = BLEND_MB,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_classes, self.probabilities = num_classes, probabilities
        layout = BlendLayout(tiles_to_predict, own_ids, cores, width, height, taper)
        site = RasterSite(out_path, transform, crs, parts, keep_unsaved, block_rows)
        super().__init__(layout, num_classes, site, blend_mb, device)

    def open_raster(self, site: RasterSite, width: int, height: int) -> RankRaster:
        return RankRaster(site, width, height, self.num_classes if self.probabilities else 0)

    @property
    def weighed(self) -> bool:
        """The weights' sum only for the probabilities (the classes are the argmax of the weighted sums)."""
        return self.probabilities

    def finish(self, weighted: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The classes (argmax of the sums: the first of equal sums) and, when asked, the probabilities as
        round(p * 255) (half to even), written into one uint8 tensor."""
        bands = torch.empty((self.raster.count, *weighted.shape[1:]), dtype=torch.uint8, device=weighted.device)
        first_argmax(weighted, out=bands[0])
        if weights is not None:
            bands[1:] = (weighted / weights).clamp_(0.0, 1.0).mul_(255.0).round_()
        return bands


def first_argmax(values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (h, w, uint8): the index of each pixel's largest value over (C, h, w), the first of equal ones
    (numpy's argmax), a pass per class (torch's argmax over the first dimension of a small tensor is far slower on
    CPUs)."""
    if values.shape[0] == 1:
        return out.zero_()
    torch.gt(values[1], values[0], out=out)  # class 1 where it beats class 0 (a comparison into uint8: 0 or 1)
    best = values[0]
    for k in range(2, values.shape[0]):
        best = torch.maximum(best, values[k - 1])
        out.masked_fill_(values[k] > best, k)
    return out
