"""The torch half of the tasks that predict a value per pixel and blend their tiles (segmentation's classes,
regression's values): a rank's blended raster of a scene as its rank output, and the tiles a rank predicts (its
own and their neighbours', whose predictions its cores' blend needs); their training samples (a target raster per
tile: :class:`DenseTileDataset`), their start from encoder weights or a model file, and the check that a model
file's weights fit (:func:`load_weights`). What their rasters hold, and how a piece's weighted sums become them,
is each task's :class:`~rasterscale.tasks.blending.Blender`."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from rasterio.windows import Window
from torch.utils.data import Dataset

from rasterscale.datasets.sampling import NO_FLIPS, FlippableSamples, Flips
from rasterscale.datasets.tiles import RasterHandle
from rasterscale.errors import InputError
from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec, read_masked
from rasterscale.runtime.fastpath import fuse_conv_bn, to_channels_last
from rasterscale.scene import Scene
from rasterscale.settings import Settings, TrainSettings
from rasterscale.tasks.api import PredictScene, RankOutput, SizedDataset, Task
from rasterscale.tasks.blender import Blender
from rasterscale.tasks.blending import halo_tiles, tile_cores
from rasterscale.tasks.inputlayer import adapt_state_dict, and_then
from rasterscale.tasks.spec import Part


def collate_stack(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch of (tile, target raster) samples: both stacked."""
    images, targets = zip(*batch, strict=True)
    return torch.stack(images), torch.stack(targets)


class DenseTileDataset(Dataset):
    """A scene's training tiles with their targets, a raster each (class ids, values): item -> (float image
    (B, h, w), targets (..., h, w): :meth:`targets_of`). ``sample``: the same, image and targets flipped together
    (training's augmentation: :mod:`rasterscale.datasets.sampling`)."""

    def __init__(self, raster_path: str | Path, tiles: Sequence[Tile], spec: ImageSpec) -> None:
        self.raster = RasterHandle(raster_path, spec)
        self.tiles = list(tiles)

    def __len__(self) -> int:
        return len(self.tiles)

    def masked(self, window: Window, targets: np.ndarray, empty: float) -> np.ndarray:
        """``targets`` (..., h, w) of a tile's ``window``, ``empty`` where the imagery is masked (the spec's mask)."""
        if self.raster.spec.mask != "none":
            valid = read_masked(self.raster.src, self.raster.spec, window=window)[1]
            if valid is not None:
                targets[..., ~valid] = empty
        return targets

    def targets_of(self, tile: Tile) -> torch.Tensor:
        """A tile's targets, as the loss takes them."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(index, NO_FLIPS)

    def sample(self, index: int, flips: Flips) -> tuple[torch.Tensor, torch.Tensor]:
        tile = self.tiles[index]
        image = self.raster.read_rgb(tile)
        targets = self.targets_of(tile)
        if flips.horizontal:
            image, targets = image.flip(-1), targets.flip(-1)
        if flips.vertical:
            image, targets = image.flip(-2), targets.flip(-2)
        return image.contiguous(), targets.contiguous()


def load_weights(
    model: torch.nn.Module, payload: Mapping[str, Any], path: str | Path, describe: Callable[[], str]
) -> None:
    """Load a model file's weights (its payload's ``state_dict``) into ``model``; weights that do not fit it raise
    a one-line InputError naming the file and the model (``describe()``)."""
    try:
        model.load_state_dict(payload["state_dict"])
    except RuntimeError as err:
        lines = str(err).splitlines()
        detail = (lines[1] if len(lines) > 1 else lines[0]).strip()[:160]
        raise InputError(f"{path}: weights do not fit {describe()} ({detail})") from None


def start_from_same_network(
    model: torch.nn.Module, model_cfg: Any, start: torch.nn.Module, start_cfg: Any, init: str
) -> str:
    """Load into ``model`` the weights of ``start`` (the task's model file ``init``, on the same network; its first
    convolution adapted to ``model_cfg``'s bands) whose shapes match: all of them, or all but the head's where it
    gives another number of channels. A line for the log."""
    state, adapted = adapt_state_dict(start.state_dict(), model_cfg.input, start_cfg.input)
    own = model.state_dict()
    kept = {key: value for key, value in state.items() if key in own and own[key].shape == value.shape}
    model.load_state_dict(kept, strict=False)
    head = "" if len(kept) == len(own) else f"; {len(own) - len(kept)} tensors (the head) new"
    return f"weights from {init} ({start_cfg.describe()}){and_then(adapted)}{head}"


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

    def add_batch(self, tiles: Sequence[Tile], result: torch.Tensor) -> None:
        self.blender.add_batch([tile.tile_id for tile in tiles], result)

    def stage_seconds(self) -> dict[str, float]:
        busy, blocked = self.blender.write_s
        return {"write_wait": blocked, "writer": busy}

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
    """What a blending task inherits: its scenes' tile cores, computed once per scene of a job, the tiles a
    rank predicts, its rank outputs (rasters of its :attr:`blender`), its training samples (of its
    :meth:`tile_samples`) and its start from ``model.encoder_weights`` or ``train.init``."""

    blender: ClassVar[Callable[..., Blender]]  # the blender of its rank rasters (TileBlender, ValueBlender)
    blended: ClassVar[str]  # what they hold, for the log ("classes", "values")

    def __init__(self) -> None:
        self.cores: dict[str, dict[int, Any]] = {}  # scene name -> its tiles' cores (a rank needs them twice)

    def describe(self, model_cfg: Any) -> str:
        return model_cfg.describe()

    def initial_weights(self, model: torch.nn.Module, model_cfg: Any, settings: Settings) -> str:
        """Start the model's encoder from ``model.encoder_weights``, or the model from ``train.init``
        (:meth:`start_from`), or from scratch."""
        init, encoder_weights = settings.train.init, settings.model.encoder_weights
        if encoder_weights:  # the dry run refuses it beside train.init
            return self.start_encoder(model, model_cfg, encoder_weights)
        if not init:
            return "no weights: training from scratch (random initialization)"
        return self.start_from(model, model_cfg, init)

    @abstractmethod
    def start_encoder(self, model: torch.nn.Module, model_cfg: Any, path: str) -> str:
        """Start the model's encoder from a local weights file; a line for the log."""

    @abstractmethod
    def start_from(self, model: torch.nn.Module, model_cfg: Any, init: str) -> str:
        """Start the model from the task's model file ``init``; a line for the log."""

    def training_datasets(
        self,
        scene: Scene,
        model_cfg: Any,
        train: Sequence[Tile],
        validation: Sequence[Tile],
        spec: ImageSpec,
        train_settings: TrainSettings,
    ) -> tuple[FlippableSamples, SizedDataset | None]:
        samples = self.tile_samples(scene, model_cfg, spec)
        return samples(train), (samples(validation) if validation else None)

    @abstractmethod
    def tile_samples(
        self, scene: Scene, model_cfg: Any, spec: ImageSpec
    ) -> Callable[[Sequence[Tile]], DenseTileDataset]:
        """The samples of a scene's tiles (given when called), its ground truth read once for them all."""

    def collate(self, batch: list[Any]) -> Any:
        return collate_stack(batch)

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

    @abstractmethod
    def blended_bands(self, model_cfg: Any) -> Any:
        """What the blender blends per pixel, as it takes it: the number of classes, the values' labels."""

    def blend_options(self, settings: Settings) -> dict[str, Any]:
        """The blender's options that the config sets (none unless the task says)."""
        return {}

    def rank_output(
        self,
        scene: PredictScene,
        own: Sequence[Tile],
        predicted: Sequence[Tile],
        path: str | Path,
        model_cfg: Any,
        settings: Settings,
        parts: Sequence[Part] | None = None,
        device: torch.device | None = None,
    ) -> RankOutput:
        blender = self.blender(
            list(predicted),
            {t.tile_id for t in own},
            self.cores_of(scene),
            scene.width,
            scene.height,
            self.blended_bands(model_cfg),
            scene.grid.overlap,
            path,
            scene.transform,
            scene.crs,
            **self.blend_options(settings),
            parts=[part.path for part in parts or ()],
            keep_unsaved=parts is not None,
            blend_mb=settings.predict.blend_mb,
            device=device or torch.device("cpu"),
        )
        return BlendedRankOutput(blender, path, self.blended)
