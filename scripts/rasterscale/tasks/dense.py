"""The torch half of the tasks that predict a value per pixel and blend their tiles (segmentation's classes,
regression's values): a rank's blended raster of a scene as its rank output, and the tiles a rank predicts (its
own and their neighbours', whose predictions its cores' blend needs). What their rasters hold, and how a piece's
weighted sums become them, is each task's :class:`~rasterscale.tasks.blending.Blender`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rasterscale.grid.tile import Tile
from rasterscale.runtime.fastpath import fuse_conv_bn, to_channels_last
from rasterscale.tasks.api import PredictScene, RankOutput, Task
from rasterscale.tasks.blending import Blender, halo_tiles, tile_cores
from rasterscale.tasks.spec import Part


def collate_stack(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch of (tile, target raster) samples: both stacked."""
    images, targets = zip(*batch, strict=True)
    return torch.stack(images), torch.stack(targets)


def prepare_dense_for_inference(model: torch.nn.Module, net: torch.nn.Module, channels_last: bool) -> torch.nn.Module:
    """A dense model's fast path: eval mode, batch norms folded into convolutions, and (when asked) channels_last
    weights of its network ``net`` and inputs (its last layer is in fp32 under autocast as built)."""
    model.eval()
    fuse_conv_bn(model)
    if channels_last:
        to_channels_last(model, net)
    return model


class BlendedRankOutput(RankOutput):
    """A rank's raster of one scene: the blended ``what`` (classes, values) of its own tiles' cores (a part: the
    blocks of it written since the previous one)."""

    def __init__(self, blender: Blender, path: str | Path, what: str) -> None:
        self.blender, self.path, self.what = blender, path, what

    def add(self, tile: Tile, result: np.ndarray) -> None:
        self.blender.add(tile.tile_id, result)

    def save_part(self, path: Path) -> Part | None:
        written = self.blender.save_part(path)
        if written is None:
            return None
        tiles, blocks = written
        return Part(path, tiles, {"blocks": blocks})

    def unsaved_bytes(self) -> int:
        return self.blender.unsaved_bytes()

    def write(self) -> str:
        written = self.blender.close()
        parts = self.blender.raster.parts
        resumed = f" ({len(parts)} part(s) of an earlier run)" if parts else ""
        return f"{self.what} of {len(written)} tile cores{resumed} -> {self.path}"


class DenseTask(Task):
    """What a blending task inherits: its scenes' tile cores, computed once per scene of a job, and the tiles a
    rank predicts."""

    def __init__(self) -> None:
        self.cores: dict[str, dict[int, Any]] = {}  # scene name -> its tiles' cores (a rank needs them twice)

    def cores_of(self, scene: PredictScene) -> dict[int, Any]:
        """The cores of a scene's tiles (:func:`~rasterscale.tasks.blending.tile_cores`), once per scene."""
        if scene.name not in self.cores:
            self.cores[scene.name] = tile_cores(scene.tiles, scene.width, scene.height)
        return self.cores[scene.name]

    def tiles_to_predict(self, scene: PredictScene, own: Sequence[Tile]) -> list[Tile]:
        """The rank's own tiles and every tile overlapping one of their cores (their blend needs them)."""
        if not own:
            return []
        return halo_tiles(scene.tiles, {t.tile_id for t in own}, self.cores_of(scene))
