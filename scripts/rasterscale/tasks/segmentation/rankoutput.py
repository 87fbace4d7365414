"""A rank's class raster: band 1 the class ids, and optionally bands 2.. the class probabilities as round(p * 255),
written block by block as the blender finishes the pieces of it, in any order
(:class:`~rasterscale.tasks.blending.BlockRaster`, shared with the other blending tasks, says how; the merge reads
it block by block too). Blocks no piece covers hold no data (class :data:`NODATA_CLASS`, probabilities 0).
"""

from __future__ import annotations

from rasterscale.tasks.blending import (
    BLOCK_COLS,
    BLOCK_ROWS,
    BLOCKS_TAG,
    BlockRaster,
    RasterSite,
    block_span,
    covered_pixels,
)
from rasterscale.tasks.segmentation import NODATA_CLASS, PROBABILITY_SCALE

__all__ = ["BLOCKS_TAG", "BLOCK_COLS", "BLOCK_ROWS", "PROBABILITY_SCALE", "RankRaster", "block_span", "covered_pixels"]


class RankRaster(BlockRaster):
    """The class raster (band 1 class ids, bands 2.. the probabilities as round(p * 255) when ``probabilities``
    of them are asked for) of a rank's window of the scene, written atomically at ``site``."""

    def __init__(
        self, site: RasterSite, width: int, height: int, probabilities: int = 0, block_cols: int = BLOCK_COLS
    ) -> None:
        self.probabilities = probabilities
        super().__init__(
            site,
            width,
            height,
            1 + probabilities,
            "uint8",
            (NODATA_CLASS, *[0] * probabilities),
            # per dataset in GeoTIFF: set only when no band holds 255 as data
            nodata=None if probabilities else NODATA_CLASS,
            scales=(1.0, *[PROBABILITY_SCALE] * probabilities) if probabilities else None,
            descriptions=("class", *[f"probability of class {k}" for k in range(probabilities)])
            if probabilities
            else None,
            block_cols=block_cols,
        )
