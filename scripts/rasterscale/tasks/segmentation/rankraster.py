"""A rank's class raster: band 1 the class ids, and optionally bands 2.. the class probabilities as round(p * 255),
written block by block as the blender finishes the pieces of it, in any order
(:class:`~rasterscale.tasks.blending.BlockRaster`, shared with the other blending tasks, says how; the merge reads
it block by block too). Blocks no piece covers hold no data (class :data:`NODATA_CLASS`, probabilities 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from affine import Affine

from rasterscale.tasks.blending import BLOCK_COLS, BLOCK_ROWS, BLOCKS_TAG, BlockRaster, block_span, covered_pixels
from rasterscale.tasks.segmentation import NODATA_CLASS

__all__ = ["BLOCKS_TAG", "BLOCK_COLS", "BLOCK_ROWS", "PROBABILITY_SCALE", "RankRaster", "block_span", "covered_pixels"]

PROBABILITY_SCALE = 1 / 255  # probability bands hold round(p * 255)


class RankRaster(BlockRaster):
    """The class raster (band 1 class ids, bands 2.. the probabilities as round(p * 255) when ``probabilities``
    of them are asked for) of a rank's window of the scene, written atomically at ``path``."""

    def __init__(
        self,
        path: str | Path,
        width: int,
        height: int,
        transform: Affine,
        crs: object,
        probabilities: int = 0,
        parts: Sequence[str | Path] = (),
        keep_unsaved: bool = False,
        block_rows: int = BLOCK_ROWS,
        block_cols: int = BLOCK_COLS,
    ) -> None:
        self.probabilities = probabilities
        super().__init__(
            path,
            width,
            height,
            transform,
            crs,
            1 + probabilities,
            "uint8",
            (NODATA_CLASS, *[0] * probabilities),
            # per dataset in GeoTIFF: set only when no band holds 255 as data
            nodata=None if probabilities else NODATA_CLASS,
            scales=(1.0, *[PROBABILITY_SCALE] * probabilities) if probabilities else None,
            descriptions=("class", *[f"probability of class {k}" for k in range(probabilities)])
            if probabilities
            else None,
            parts=parts,
            keep_unsaved=keep_unsaved,
            block_rows=block_rows,
            block_cols=block_cols,
        )
