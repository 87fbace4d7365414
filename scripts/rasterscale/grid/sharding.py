"""How a batch of scenes' tiles is split over shards (jobs) and ranks: balanced, contiguous parts of the manifest
order, so that each rank reads a band of each raster. Task-neutral: it knows tiles, not what is predicted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from rasterscale.grid.tile import Tile

T = TypeVar("T")


def split_balanced(items: Sequence[T], parts: int, index: int) -> list[T]:
    """Part ``index`` of ``parts`` contiguous parts whose sizes differ by at most one."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of range for {parts} parts")
    base, extra = divmod(len(items), parts)
    start = index * base + min(index, extra)
    return list(items[start : start + base + (1 if index < extra else 0)])


def rank_tiles(tiles: Sequence[Any], shards: int, shard: int, world_size: int, rank: int) -> list[Any]:
    """One rank's part of one shard's part of ``tiles``."""
    return split_balanced(split_balanced(tiles, shards, shard), world_size, rank)


def batch_rank_tiles(
    scene_tiles: Sequence[Sequence[Tile]], shards: int, shard: int, world_size: int, rank: int
) -> list[list[Tile]]:
    """Each scene's tiles of one rank: the batch's tiles, scene after scene, split as :func:`rank_tiles` splits
    one scene's (so that many small scenes balance over the ranks as one large one does)."""
    keyed = [(index, tile) for index, tiles in enumerate(scene_tiles) for tile in tiles]
    own: list[list[Tile]] = [[] for _ in scene_tiles]
    for index, tile in rank_tiles(keyed, shards, shard, world_size, rank):
        own[index].append(tile)
    return own


def rank_file_index(shard: int, world_size: int, rank: int) -> int:
    """The index of a rank's files among a scene's (``rank-{index}``): shard after shard, rank after rank."""
    return shard * world_size + rank
