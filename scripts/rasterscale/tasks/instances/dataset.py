"""Instance segmentation's training samples: tiles of a scene with the crowns they hold as torchvision Mask
R-CNN's targets (boxes, labels, masks), flipped as the sampling says.

A crown is in a tile when enough of its area lies inside it (``min_visible_fraction``, as detection's boxes); its
mask is the polygon burnt into the tile's pixels (a pixel is in when its centre is: the part of the crown inside
the tile), its box the mask's extent (pixel edges), so that box and mask always agree. A crown whose mask holds no
pixel centre (a sliver along the tile's edge) is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import shapely
import torch
from affine import Affine
from rasterio.features import rasterize
from torch.utils.data import Dataset

from rasterscale.datasets.sampling import NO_FLIPS, Flips
from rasterscale.datasets.tiles import RasterHandle
from rasterscale.grid.tile import Tile
from rasterscale.raster.geo import GeometryIndex
from rasterscale.raster.imagery import ImageSpec
from rasterscale.tasks.instances.groundtruth import GroundTruth


def polygon_mask(polygon: shapely.Geometry, height: int, width: int) -> np.ndarray:
    """A polygon in a tile's pixels burnt into a (height, width) uint8 mask (pixel centres inside it), rasterized
    over its bounding window only."""
    mask = np.zeros((height, width), dtype=np.uint8)
    x0, y0, x1, y1 = polygon.bounds
    col0, row0 = max(int(np.floor(x0)), 0), max(int(np.floor(y0)), 0)
    col1, row1 = min(int(np.ceil(x1)), width), min(int(np.ceil(y1)), height)
    if col1 > col0 and row1 > row0:
        mask[row0:row1, col0:col1] = rasterize(
            [(polygon, 1)],
            out_shape=(row1 - row0, col1 - col0),
            transform=Affine.translation(col0, row0),
            fill=0,
            all_touched=False,
            dtype="uint8",
        )
    return mask


def mask_boxes(masks: np.ndarray) -> np.ndarray:
    """(N, 4) float32 boxes ``xmin, ymin, xmax, ymax`` (pixel edges) of (N, H, W) non-empty masks."""
    boxes = np.zeros((len(masks), 4), dtype=np.float32)
    for k, mask in enumerate(masks):
        rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
        boxes[k] = (cols[0], rows[0], cols[-1] + 1, rows[-1] + 1)
    return boxes


def flip_image_and_masks(image: torch.Tensor, masks: torch.Tensor, flips: Flips) -> tuple[torch.Tensor, torch.Tensor]:
    """The (C, H, W) image and its (N, H, W) masks flipped alike."""
    dims = [dim for dim, flipped in ((-1, flips.horizontal), (-2, flips.vertical)) if flipped]
    return (image.flip(dims), masks.flip(dims)) if dims else (image, masks)


class InstanceTileDataset(Dataset):
    """Training tiles with the crowns they hold: item -> (image, target) with target torchvision Mask R-CNN's
    ``boxes`` (N, 4) float32 tile pixels, ``labels`` (N,) int64 (0-based: the model adds the background) and
    ``masks`` (N, H, W) uint8; ``sample``: the same, flipped (training's augmentation:
    :mod:`rasterscale.datasets.sampling`). Pickles for dataloader workers (its STRtree is built in each)."""

    def __init__(
        self,
        raster_path: str | Path,
        tiles: Sequence[Tile],
        spec: ImageSpec,
        truth: GroundTruth,
        min_visible_fraction: float = 0.5,
    ) -> None:
        self.raster = RasterHandle(raster_path, spec)
        self.tiles = list(tiles)
        self.polygons = np.asarray(truth.polygons, dtype=object)
        self.labels = np.asarray(truth.labels, dtype=np.int64)
        self.areas = shapely.area(self.polygons)
        self.min_visible_fraction = min_visible_fraction
        self.index = GeometryIndex(self.polygons)

    def __len__(self) -> int:
        return len(self.tiles)

    def crowns_in_tile(self, tile: Tile) -> tuple[np.ndarray, np.ndarray]:
        """The crowns enough of which lies in the tile, in tile pixels (whole: burning a polygon into the tile's
        pixels clips it, and a pixel centre on an edge falls as it does for the whole scene); and their labels."""
        frame = shapely.box(tile.col_off, tile.row_off, tile.col_off + tile.width, tile.row_off + tile.height)
        hits = self.index.query(frame, predicate="intersects")
        visible = shapely.area(shapely.intersection(self.polygons[hits], frame))
        keep = hits[(visible > 0) & (visible >= self.min_visible_fraction * self.areas[hits])]
        local = shapely.transform(self.polygons[keep], lambda xy: xy - (tile.col_off, tile.row_off))
        return np.asarray(local, dtype=object), self.labels[keep]

    def target(self, index: int) -> dict[str, torch.Tensor]:
        tile = self.tiles[index]
        polygons, labels = self.crowns_in_tile(tile)
        masks = np.zeros((len(polygons), tile.height, tile.width), dtype=np.uint8)
        for k, polygon in enumerate(polygons):
            masks[k] = polygon_mask(polygon, tile.height, tile.width)
        filled = masks.any(axis=(1, 2))
        masks, labels = masks[filled], labels[filled]
        return {
            "boxes": torch.from_numpy(mask_boxes(masks)).reshape(-1, 4),
            "labels": torch.from_numpy(labels),
            "masks": torch.from_numpy(masks),
        }

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.sample(index, NO_FLIPS)

    def sample(self, index: int, flips: Flips) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image = self.raster.read_rgb(self.tiles[index])
        target = self.target(index)
        image, target["masks"] = flip_image_and_masks(image, target["masks"], flips)
        if flips.horizontal or flips.vertical:
            target["boxes"] = torch.from_numpy(mask_boxes(target["masks"].numpy()))
        return image, target
