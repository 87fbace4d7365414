"""Blending overlapping tile values into one rank's value raster, with memory that does not grow with the raster:
segmentation's blend (:mod:`rasterscale.tasks.blending`: cores, halo tiles, weights tapering toward inner tile edges,
blocks written as they complete, parts for resume), whose core values are the weighted mean of the tiles' values.

A rank raster holds float32 values, one band per predicted value, over the bounding window of the rank's own cores;
its pixels outside them are NaN (no data: not this rank's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from affine import Affine
from rasterio.windows import Window

from rasterscale.grid.tile import Tile
from rasterscale.tasks.blender import BLEND_MB, Blender
from rasterscale.tasks.blending import BLOCK_ROWS, BlendLayout, BlockRaster, RasterSite

RANK_NODATA = float("nan")  # a rank raster's pixels that are not its own


def value_raster(site: RasterSite, width: int, height: int, labels: Sequence[str]) -> BlockRaster:
    """A rank's value raster: float32, a band per value (named after its label), NaN where no piece comes."""
    return BlockRaster(
        site,
        width,
        height,
        len(labels),
        "float32",
        [RANK_NODATA] * len(labels),
        nodata=RANK_NODATA,
        descriptions=list(labels),
    )


class ValueBlender(Blender):
    """One rank's blended value raster (:class:`~rasterscale.tasks.blending.Blender`): feed :meth:`add` every tile's
    values (K, h, w) float32 in ``tiles_to_predict`` order, then :meth:`close`. A core's value is the weighted mean
    of its contributors' values."""

    def __init__(
        self,
        tiles_to_predict: Iterable[Tile],
        own_ids: Iterable[int],
        cores: Mapping[int, Window],
        width: int,
        height: int,
        labels: Sequence[str],
        taper: int,
        out_path: str | Path,
        transform: Affine,
        crs: object,
        block_rows: int = BLOCK_ROWS,
        parts: Sequence[str | Path] = (),
        keep_unsaved: bool = False,
        blend_mb: float = BLEND_MB,
        device: torch.device | str = "cpu",
    ) -> None:
        self.labels = list(labels)
        layout = BlendLayout(tiles_to_predict, own_ids, cores, width, height, taper)
        site = RasterSite(out_path, transform, crs, parts, keep_unsaved, block_rows)
        super().__init__(layout, len(self.labels), site, blend_mb, device)

    def open_raster(self, site: RasterSite, width: int, height: int) -> BlockRaster:
        return value_raster(site, width, height, self.labels)

    def finish(self, weighted: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The weighted mean of the contributors' values (weights are floored above 0: never a division by 0)."""
        assert weights is not None, "a mean's blender is weighed"
        return weighted / weights
