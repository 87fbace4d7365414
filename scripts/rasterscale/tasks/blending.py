"""Blending overlapping tile predictions into one rank's raster, with memory that does not grow with the raster: what
the tasks that predict a value per pixel share (segmentation's class probabilities, regression's values).

Every tile of the manifest owns a *core*: along each axis, the boundary between consecutive tiles is the middle of
their overlap, so the cores partition the raster (:func:`tile_cores`; tiles left out of the manifest leave their
cores out, and those pixels are masked anyway). A rank writes the pixels of its own tiles' cores. A core's value is
the weighted mean of the values of every tile whose window intersects the core (:func:`halo_tiles` lists them: the
rank predicts its own tiles and this halo); a tile's weight falls as sin² towards its inner edges, where a model
sees least context (:func:`edge_weights`). What a task writes of the weighted sums (an argmax, the mean itself) is
its :meth:`Blender.finish`.

:class:`Blender` takes the tiles' values in manifest order. Each own core is cut in two where the next row of tiles
begins (:func:`core_pieces`): the upper piece is finished by the tiles of its own row, the lower piece (half an
overlap high) waits for the row below. A piece's weighted sum is kept from its own tile to its last contributor
(earlier tiles' slivers of overlap are kept as they are until then), so what waits for the next row is the lower
pieces: half an overlap of rows across the rank's width, not a row of tiles. Pieces whose next tile is far ahead
wait on disk (:class:`SpilledPieces`), so the rank's memory does not grow with that width either. A finished piece
goes straight into the rank raster (:class:`BlockRaster`), which writes each block of it once every piece covering
the block is in: no row of the raster is ever held whole. Sums run over the contributors in manifest order, so a
pixel's value is the same whichever rank owns it.

Written blocks are final data, so they are also what a rank saves (:meth:`Blender.save_part`: a part of the blocks
written since the previous one, and the own tiles whose cores the parts now hold entirely). A blender resumed from
such parts copies their blocks into its raster first and blends only the cores they do not hold entirely (never
writing a block of the parts again).

The rank raster (:class:`BlockRaster`) is tiled in blocks :data:`BLOCK_ROWS` high and :data:`BLOCK_COLS` wide (the
merge reads it block by block too). Finished rectangles of data (:meth:`BlockRaster.put`) are copied into the
buffers of the blocks they cover; a block is written as soon as every pixel of it that some piece will cover has
come (:meth:`BlockRaster.expect` counts them), and its buffer dropped: what a rank holds is the blocks that straddle
the edges of unfinished pieces. Blocks no piece covers hold the raster's empty value. For tile-level resume, the
blocks written since the previous part are kept and written as a *part* (:meth:`BlockRaster.save_part`): a small
GeoTIFF of the blocks stacked one above the other, their places in its ``rasterscale_blocks`` tag.

A scene's merge opens the scene's raster and the rank rasters (:func:`open_merge_sources`), each placed on the
scene's grid (:func:`rank_window`), and reads them block by block (:func:`block_windows`), masked pixels from the
scene's imagery (:func:`window_valid_mask`), into a scratch raster beside the output (:func:`scratch_path`) that
becomes its COG. A project's layer is a VRT over its scenes' and seams' merged rasters (:func:`write_project_mosaic`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from abc import ABC, abstractmethod
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

import numpy as np
import rasterio
from affine import Affine
from rasterio.errors import NotGeoreferencedWarning
from rasterio.windows import Window

from rasterscale.atomic import atomic_path, move_into_place, temporary_sibling, writing
from rasterscale.errors import InputError
from rasterscale.grid.project import is_seam
from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import ImageSpec, decoding, read_masked
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.raster.remote import open_raster
from rasterscale.raster.windows import bounding_window, intersection, overlap_slices, tile_window, windows_intersect

BLOCK_ROWS = 32  # rows of a block of a rank raster
BLOCK_COLS = 256  # columns of a block: the merge reads a 512 px block of it without decoding whole rows
BLOCKS_TAG = "rasterscale_blocks"  # a part's tag: the (block row, block column) of each block it stacks
WEIGHT_FLOOR = 1e-3  # a tile's weight at its very edge: every pixel of a tile counts a little
SPILL_AHEAD = 16  # a piece whose next contributor is more tiles ahead than this waits on disk (SpilledPieces)


def axis_cores(spans: Mapping[int, int], length: int) -> dict[int, tuple[int, int]]:
    """Core [start, stop) of each tile offset along one axis (``spans``: offset -> tile size): cut in the middle
    of each overlap, clipped to the tile; the raster's ends bound the first and last."""
    offsets = sorted(spans)
    cuts = [0, *((offsets[i + 1] + offsets[i] + spans[offsets[i]]) // 2 for i in range(len(offsets) - 1)), length]
    return {o: (max(cuts[i], o), min(cuts[i + 1], o + spans[o])) for i, o in enumerate(offsets)}


def tile_cores(tiles: Iterable[Tile], width: int, height: int) -> dict[int, Window]:
    """The core of every tile: the cores are disjoint, each inside its tile, and cover every pixel whose tile
    row and column are in the manifest."""
    tiles = list(tiles)
    col_spans: dict[int, int] = {}
    row_spans: dict[int, int] = {}
    for tile in tiles:
        col_spans[tile.col_off] = max(col_spans.get(tile.col_off, 0), tile.width)
        row_spans[tile.row_off] = max(row_spans.get(tile.row_off, 0), tile.height)
    cols, rows = axis_cores(col_spans, width), axis_cores(row_spans, height)
    cores = {}
    for tile in tiles:
        (c0, c1), (r0, r1) = cols[tile.col_off], rows[tile.row_off]
        cores[tile.tile_id] = Window(c0, r0, c1 - c0, r1 - r0)
    return cores


def core_pieces(cores: Mapping[int, Window], tiles: Iterable[Tile]) -> list[tuple[int, Window]]:
    """Each core cut where the next row of tiles begins: (tile id, window) of its upper piece, which the tiles of
    its own row (and the row above) finish, and of its lower piece, which waits for the row below. Holding the
    lower pieces only, a rank's pending sums span a few dozen rows across the raster, not a row of tiles."""
    starts = sorted({t.row_off for t in tiles})
    pieces = []
    for tile_id, core in cores.items():
        after = bisect_right(starts, core.row_off)  # the first row of tiles below the core's top
        cut = starts[after] if after < len(starts) and starts[after] < core.row_off + core.height else None
        if cut is None:
            pieces.append((tile_id, core))
        else:
            pieces.append((tile_id, Window(core.col_off, core.row_off, core.width, cut - core.row_off)))
            pieces.append((tile_id, Window(core.col_off, cut, core.width, core.row_off + core.height - cut)))
    return pieces


class TilesByWindow:
    """Tiles looked up by the window they intersect (offsets bisected along each axis)."""

    def __init__(self, tiles: Iterable[Tile]) -> None:
        self.by_offset = {(t.row_off, t.col_off): t for t in tiles}
        self.rows = sorted({row for row, _ in self.by_offset})
        self.cols = sorted({col for _, col in self.by_offset})
        self.max_height = max((t.height for t in self.by_offset.values()), default=0)
        self.max_width = max((t.width for t in self.by_offset.values()), default=0)

    def intersecting(self, window: Window) -> list[Tile]:
        """Tiles whose window intersects ``window``, in manifest order (row_off, col_off)."""
        r0 = bisect_left(self.rows, window.row_off - self.max_height + 1)
        r1 = bisect_left(self.rows, window.row_off + window.height)
        c0 = bisect_left(self.cols, window.col_off - self.max_width + 1)
        c1 = bisect_left(self.cols, window.col_off + window.width)
        found = []
        for row in self.rows[r0:r1]:
            for col in self.cols[c0:c1]:
                tile = self.by_offset.get((row, col))
                if tile is not None and windows_intersect(tile_window(tile), window):
                    found.append(tile)
        return found


def halo_tiles(all_tiles: Iterable[Tile], own_ids: Iterable[int], cores: Mapping[int, Window]) -> list[Tile]:
    """The tiles a rank predicts: every tile of the manifest whose window intersects the core of an own tile (the
    own tiles among them), in manifest order."""
    grid = TilesByWindow(all_tiles)
    found: dict[int, Tile] = {}
    for tile_id in own_ids:
        for tile in grid.intersecting(cores[tile_id]):
            found[tile.tile_id] = tile
    return sorted(found.values(), key=lambda t: (t.row_off, t.col_off))


def axis_weights(offset: int, size: int, length: int, taper: int) -> np.ndarray:
    """1-D weights of a tile along one axis: sin² (a Hann half-window) over ``taper`` px from each edge that is
    not the raster's, 1 elsewhere."""
    weights = np.ones(size, dtype=np.float64)
    ramp_size = min(taper, size)
    if ramp_size > 0:
        ramp = np.sin(np.pi / 2 * (np.arange(ramp_size) + 0.5) / taper) ** 2
        if offset > 0:
            weights[:ramp_size] *= ramp
        if offset + size < length:
            weights[size - ramp_size :] *= ramp[::-1]
    return weights


def edge_weights(tile: Tile, width: int, height: int, taper: int) -> np.ndarray:
    """(height, width) float32 blending weights of a tile: outer product of the row and column windows of
    :func:`axis_weights`, floored at :data:`WEIGHT_FLOOR`."""
    rows = axis_weights(tile.row_off, tile.height, height, taper)
    cols = axis_weights(tile.col_off, tile.width, width, taper)
    return np.maximum(np.outer(rows, cols), WEIGHT_FLOOR).astype(np.float32)


def spill_folder(out_path: str | Path) -> Path:
    """Where a rank's blender spills pieces: a hidden folder beside its raster (not the node's /tmp, often memory
    itself), removed when the blender closes."""
    out_path = Path(out_path)
    return out_path.with_name(f".{out_path.name}.spill-{os.getpid()}")


Sums = tuple[np.ndarray, np.ndarray]  # Σ w·v (C, h, w), Σ w (h, w)
Sliver = tuple[tuple[slice, slice], np.ndarray, np.ndarray]  # (rows, cols) of the core, w·v, w


class SpilledPieces:
    """The blend state (sums, slivers) of pieces whose next contributor is far ahead, on disk: one file per
    piece, read back (and removed) when that tile comes. Row after row, these are the pieces of the overlap
    between two rows of tiles, which span the raster's width: spilled, they leave the rank's memory flat however
    wide the raster is. A piece is an ``.npz`` of plain arrays (read back with ``allow_pickle=False``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pieces: set[int] = set()
        self.written_bytes = 0

    def __contains__(self, piece: int) -> bool:
        return piece in self.pieces

    def _path(self, piece: int) -> Path:
        return self.folder / f"{piece}.npz"

    def put(self, piece: int, sums: Sums | None, slivers: list[Sliver] | None) -> None:
        self.folder.mkdir(exist_ok=True)
        arrays: dict[str, Any] = {"slivers": np.int64(-1 if slivers is None else len(slivers))}
        if sums is not None:
            arrays["acc"], arrays["weight"] = sums
        for k, ((rows, cols), weighted, weights) in enumerate(slivers or []):
            arrays[f"sliver{k}_at"] = np.array([rows.start, rows.stop, cols.start, cols.stop], dtype=np.int64)
            arrays[f"sliver{k}_weighted"], arrays[f"sliver{k}_weights"] = weighted, weights
        with open(self._path(piece), "wb") as handle:
            np.savez(handle, **arrays)
            self.written_bytes += handle.tell()
        self.pieces.add(piece)

    def take(self, piece: int) -> tuple[Sums | None, list[Sliver] | None]:
        path = self._path(piece)
        with np.load(path, allow_pickle=False) as stored:
            sums = (stored["acc"], stored["weight"]) if "acc" in stored.files else None
            count = int(stored["slivers"])
            slivers = None if count < 0 else [self._sliver(stored, k) for k in range(count)]
        path.unlink()
        self.pieces.discard(piece)
        return sums, slivers

    @staticmethod
    def _sliver(stored: Any, k: int) -> Sliver:
        r0, r1, c0, c1 = (int(v) for v in stored[f"sliver{k}_at"])
        return (slice(r0, r1), slice(c0, c1)), stored[f"sliver{k}_weighted"], stored[f"sliver{k}_weights"]

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.pieces.clear()


@dataclass(frozen=True)
class BlendLayout:
    """What a rank blends: the tiles it predicts (own and halo tiles, :func:`halo_tiles`, in that order), its own
    tiles' ids, every tile's core (:func:`tile_cores`), the scene's size in pixels, and the width of the tiles'
    weights' taper (:func:`edge_weights`)."""

    tiles_to_predict: Iterable[Tile]
    own_ids: Iterable[int]
    cores: Mapping[int, Window]
    width: int
    height: int
    taper: int


@dataclass(frozen=True)
class RasterSite:
    """Where a rank raster is written and how: its path, the georeference of its top-left pixel (``transform``)
    and ``crs``, the parts of an earlier run it is resumed from, whether it keeps the blocks written since the last
    part (for the next one), and its blocks' height."""

    path: str | Path
    transform: Affine
    crs: object
    parts: Sequence[str | Path] = ()
    keep_unsaved: bool = False
    block_rows: int = BLOCK_ROWS

    def at(self, window: Window) -> RasterSite:
        """The site of a raster over ``window`` of this one: its transform moved to the window's top-left pixel."""
        return replace(self, transform=self.transform @ Affine.translation(window.col_off, window.row_off))


class Blender(ABC):
    """One rank's blended raster (see the module docstring). Feed :meth:`add` every tile of the layout's
    ``tiles_to_predict`` (own and halo tiles, :func:`halo_tiles`) in that order, then :meth:`close`. A task says
    what its raster is (:meth:`open_raster`) and what a finished piece's weighted sums become in it
    (:meth:`finish`).

    The rank raster (a :class:`BlockRaster` at ``site``, whose transform is the scene's) covers the bounding window
    of the own cores, and holds the raster's empty value elsewhere. It is written block by block, atomically; GDAL's
    block cache bound is the caller's (:func:`rasterscale.datasets.tiles.limit_read_cache`). A rank without own
    tiles writes one empty pixel.

    ``channels``: the values per pixel of a tile (C of :meth:`add`). The site's ``parts``: parts an earlier run of
    the rank wrote (:meth:`save_part`), copied first; the own cores they hold entirely are not blended again. Its
    ``keep_unsaved``: keep the blocks written since the last part, for :meth:`save_part`. ``spill_ahead``: a piece
    whose next contributor is more tiles ahead waits on disk (:class:`SpilledPieces`).
    """

    def __init__(self, layout: BlendLayout, channels: int, site: RasterSite, spill_ahead: int = SPILL_AHEAD) -> None:
        self.tiles = list(layout.tiles_to_predict)
        self.spill_ahead = spill_ahead
        self.width, self.height, self.channels, self.taper = layout.width, layout.height, channels, layout.taper
        self.cores = cores = layout.cores
        self.own_ids = set(layout.own_ids)
        self.window = bounding_window(cores[i] for i in self.own_ids) or Window(0, 0, 1, 1)
        self.raster = self.open_raster(site.at(self.window), self.window.width, self.window.height)
        self.closed = False
        try:
            # own cores that the parts hold entirely: not blended again
            self.saved = {i for i in self.own_ids if self.raster.holds(self._local(cores[i]))}
            own_ids = self.own_ids - self.saved
            known = {t.tile_id for t in self.tiles}
            if own_ids - known:
                raise ValueError(f"own tiles not among the tiles to predict: {sorted(own_ids - known)[:10]}")
            self.pieces = core_pieces({i: cores[i] for i in own_ids}, self.tiles)  # piece -> (own id, window)
            self.raster.expect(self._local(window) for _, window in self.pieces)
        except BaseException:
            self.raster.abort()
            self.closed = True
            raise
        self.remaining, self.contributors, self.targets = self._contributors()
        self.next_index = 0
        self.sums: dict[int, Sums] = {}  # piece -> (Σ w·v (C,h,w), Σ w (h,w))
        self.slivers: dict[int, list[Sliver]] = {}  # piece -> contributions of earlier tiles, until its own tile comes
        self.spilled = SpilledPieces(spill_folder(site.path))  # pieces waiting for a tile far ahead
        self.peak_pending_bytes = 0

    @abstractmethod
    def open_raster(self, site: RasterSite, width: int, height: int) -> BlockRaster:
        """The rank raster: ``width`` x ``height`` px at ``site`` (resumed from its parts)."""

    @abstractmethod
    def finish(self, weighted: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """A finished piece's bands in the rank raster (``raster.count``, h, w) from its sums: Σ w·v (C, h, w) and
        Σ w (h, w), float32."""

    def _local(self, window: Window) -> Window:
        """A window of the scene in the rank raster's pixels."""
        return Window(
            window.col_off - self.window.col_off, window.row_off - self.window.row_off, window.width, window.height
        )

    def _contributors(self) -> tuple[dict[int, int], dict[int, list[int]], dict[int, list[int]]]:
        """Per piece of an own core, how many tiles intersect it, and their places in ``tiles``; per tile, the
        pieces it contributes to."""
        grid = TilesByWindow(self.tiles)
        place = {tile.tile_id: k for k, tile in enumerate(self.tiles)}
        remaining: dict[int, int] = {}
        places: dict[int, list[int]] = {}
        targets: dict[int, list[int]] = {}
        for piece, (_, window) in enumerate(self.pieces):
            contributors = grid.intersecting(window)
            remaining[piece] = len(contributors)
            places[piece] = sorted(place[tile.tile_id] for tile in contributors)
            for tile in contributors:
                targets.setdefault(tile.tile_id, []).append(piece)
        return remaining, places, targets

    def _next_contributor(self, piece: int) -> int:
        """The place in ``tiles`` of the next tile a piece waits for."""
        places = self.contributors[piece]
        return places[len(places) - self.remaining[piece]]

    @property
    def pending_bytes(self) -> int:
        """Bytes held for unfinished pieces (their sums and slivers) and by the rank raster (blocks partly
        filled, blocks not in a part yet)."""
        sums = sum(acc.nbytes + weight.nbytes for acc, weight in self.sums.values())
        sums += sum(p.nbytes + w.nbytes for parts in self.slivers.values() for _, p, w in parts)
        return sums + self.raster.pending_bytes

    def add(self, tile_id: int, values: np.ndarray) -> None:
        """A tile's values, (C, h, w) float32; tiles come in ``tiles_to_predict`` order."""
        if self.next_index >= len(self.tiles) or self.tiles[self.next_index].tile_id != tile_id:
            expected = self.tiles[self.next_index].tile_id if self.next_index < len(self.tiles) else None
            raise ValueError(f"tile {tile_id} added out of order (expected {expected})")
        tile = self.tiles[self.next_index]
        if values.shape != (self.channels, tile.height, tile.width):
            raise ValueError(
                f"tile {tile_id}: values of shape {values.shape}, expected {(self.channels, tile.height, tile.width)}"
            )
        place = self.next_index
        self.next_index += 1
        targets = self.targets.get(tile_id, [])
        if not targets:
            return
        for piece in targets:
            if piece in self.spilled:
                self._restore(piece)
        weights = edge_weights(tile, self.width, self.height, self.taper)
        for piece in targets:
            self._accumulate(piece, tile, values, weights)
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
        for piece in targets:
            self.remaining[piece] -= 1
            if self.remaining[piece] == 0:
                self._finish_piece(piece)
            elif self._next_contributor(piece) - place > self.spill_ahead:
                self._spill(piece)

    def _spill(self, piece: int) -> None:
        """A piece's sums or slivers to disk until its next contributor comes (a full file system: the rank raster's
        DiskFullError)."""
        with self._writing():
            self.spilled.put(piece, self.sums.pop(piece, None), self.slivers.pop(piece, None))

    def _restore(self, piece: int) -> None:
        sums, slivers = self.spilled.take(piece)
        if sums is not None:
            self.sums[piece] = sums
        if slivers is not None:
            self.slivers[piece] = slivers

    def _accumulate(self, piece: int, tile: Tile, values: np.ndarray, weights: np.ndarray) -> None:
        """Add a tile's weighted values to a piece of an own core. Until the core's own tile comes, the
        contributions of earlier tiles (slivers of their overlap) are kept as they are and summed, in order, when
        it does: a piece's sums are then held from its own tile to its last contributor only."""
        own_id, core = self.pieces[piece]
        common = intersection(tile_window(tile), core)
        assert common is not None, "a tile's targets are the pieces it overlaps"
        in_tile, in_core = overlap_slices(common, tile_window(tile)), overlap_slices(common, core)
        tile_weights = weights[in_tile]
        contribution = (in_core, values[(slice(None), *in_tile)] * tile_weights, tile_weights)
        if piece not in self.sums:
            if tile.tile_id != own_id and self.remaining[piece] > 1:
                self.slivers.setdefault(piece, []).append((in_core, contribution[1], tile_weights.copy()))
                return
            shape = (int(core.height), int(core.width))
            self.sums[piece] = (
                np.zeros((self.channels, *shape), dtype=np.float32),
                np.zeros(shape, dtype=np.float32),
            )
            for earlier in self.slivers.pop(piece, []):
                self._add_to_sums(piece, *earlier)
        self._add_to_sums(piece, *contribution)

    def _add_to_sums(self, piece: int, in_core: tuple[slice, slice], weighted: np.ndarray, weights: np.ndarray) -> None:
        acc, weight_sum = self.sums[piece]
        acc[(slice(None), *in_core)] += weighted
        weight_sum[in_core] += weights

    def _finish_piece(self, piece: int) -> None:
        """A piece's bands (:meth:`finish`) into the rank raster."""
        acc, weight_sum = self.sums.pop(piece)
        _, window = self.pieces[piece]
        with self._writing():
            self.raster.put(self._local(window), self.finish(acc, weight_sum))

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Within the block the blender writes (the rank raster, a part, a spilled piece): a failure aborts it (its
        spilled pieces and the raster's temporary removed), one of a full file system raised as a DiskFullError
        naming the rank raster (:func:`rasterscale.atomic.writing`)."""
        return writing(self.raster.path, on_failure=self._abort)

    def _abort(self) -> None:
        """Write nothing: the spilled pieces and the rank raster's temporary removed."""
        self.spilled.clear()
        self.raster.abort()
        self.closed = True

    def unsaved_bytes(self) -> int:
        return self.raster.unsaved_bytes()

    def save_part(self, path: str | Path) -> tuple[list[int], int] | None:
        """Write the blocks of the rank raster written since the previous part as a part, atomically at
        ``path``; the own tile ids whose cores are now all in parts, and the part's number of blocks. None when
        no block was written since."""
        with self._writing():
            blocks = self.raster.save_part(path)
        if not blocks:
            return None
        done = sorted(i for i in self.own_ids - self.saved if self.raster.holds(self._local(self.cores[i])))
        self.saved.update(done)
        return done, blocks

    def close(self) -> list[int]:
        """Move the rank raster into place; the own tile ids written. Raises (and writes nothing) when a tile
        was not added."""
        unfinished = sorted({self.pieces[piece][0] for piece, n in self.remaining.items() if n})
        self.closed = True
        self.spilled.clear()
        if unfinished or self.next_index != len(self.tiles):
            self.raster.abort()
            missing = [t.tile_id for t in self.tiles[self.next_index :]]
            raise RuntimeError(
                f"{len(unfinished)} own cores unfinished (tiles {unfinished[:10]}); "
                f"{len(missing)} tiles never added (first {missing[:10]})"
            )
        self.raster.close()
        return sorted(self.own_ids)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.closed:
            return
        if kind is None:
            self.close()
        else:
            self._abort()


# --- the rank raster ------------------------------------------------------------------------------------------


def block_span(start: int, stop: int, size: int) -> range:
    """The blocks of ``size`` px along an axis that [start, stop) touches."""
    return range(start // size, -(-stop // size))


def covered_pixels(window: Window, shape: tuple[int, int], rows: int, cols: int) -> tuple[slice, slice, np.ndarray]:
    """How many pixels of ``window`` fall into each block of a ``shape`` grid of blocks ``rows`` x ``cols``: the
    block rows and columns it touches, and the counts there (the outer product of the per-axis overlaps)."""
    r0, c0 = window.row_off, window.col_off
    r1, c1 = r0 + window.height, c0 + window.width
    block_rows, block_cols = block_span(r0, r1, rows), block_span(c0, c1, cols)
    starts_r = np.arange(block_rows.start, block_rows.stop) * rows
    starts_c = np.arange(block_cols.start, block_cols.stop) * cols
    per_row = np.minimum(starts_r + rows, r1) - np.maximum(starts_r, r0)
    per_col = np.minimum(starts_c + cols, c1) - np.maximum(starts_c, c0)
    if block_rows.stop > shape[0] or block_cols.stop > shape[1] or r0 < 0 or c0 < 0:
        raise ValueError(f"window {window} is not inside the raster's {shape} blocks")
    return (
        slice(block_rows.start, block_rows.stop),
        slice(block_cols.start, block_cols.stop),
        np.outer(per_row, per_col),
    )


class BlockRaster:
    """A rank's raster of ``count`` bands of ``dtype``, ``width`` x ``height`` px, written atomically at ``site``
    block by block (see the module docstring) and resumed from its parts. ``empty``: each band's value where no
    piece brings data; ``nodata``: the dataset's nodata value (None: none); ``scales`` and ``descriptions``: the
    bands' (None: left out). Call :meth:`expect` once with the windows the pieces will cover, :meth:`put` each
    finished piece, then :meth:`close`. Windows are in the rank raster's pixels."""

    def __init__(
        self,
        site: RasterSite,
        width: int,
        height: int,
        count: int,
        dtype: str,
        empty: Sequence[float],
        nodata: float | None = None,
        scales: Sequence[float] | None = None,
        descriptions: Sequence[str] | None = None,
        block_cols: int = BLOCK_COLS,
    ) -> None:
        if len(empty) != count:
            raise ValueError(f"{count} bands but {len(empty)} empty values")
        self.width, self.height, self.count, self.dtype = width, height, count, np.dtype(dtype)
        self.empty, self.nodata = np.asarray(empty, dtype=self.dtype), nodata
        self.block_rows, self.block_cols = site.block_rows, block_cols
        self.shape = (-(-height // self.block_rows), -(-width // block_cols))  # blocks down, across
        self.written = np.zeros(self.shape, dtype=bool)
        self.saved = np.zeros(self.shape, dtype=bool)  # written into a part (of this run or an earlier one)
        self.missing = np.zeros(self.shape, dtype=np.int32)  # pixels of a block that pieces still have to bring
        self.buffers: dict[tuple[int, int], np.ndarray] = {}  # blocks partly filled
        self.keep_unsaved = site.keep_unsaved
        self.unsaved: list[tuple[int, int, np.ndarray]] = []  # blocks written since the last part
        self.parts = [Path(p) for p in site.parts]
        self.path = Path(site.path)
        self.closed = False
        self._tmp = temporary_sibling(self.path)
        self._dst: Any = None
        with self._writing():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._dst = rasterio.open(self._tmp, "w", **self._profile(site.transform, site.crs))
            if scales is not None:
                self._dst.scales = tuple(scales)
            if descriptions is not None:
                self._dst.descriptions = tuple(descriptions)
            for part in self.parts:
                self._copy_part(part)

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Within the block the raster is written: a failure aborts it (its temporary removed), one of a full file
        system raised as a DiskFullError naming the raster (GDAL's errors do not say it)."""
        return writing(self.path, on_failure=self.abort)

    def _profile(self, transform: Affine, crs: object) -> dict:
        return {
            "driver": "GTiff",
            "width": self.width,
            "height": self.height,
            "count": self.count,
            "dtype": self.dtype.name,
            "crs": crs,
            "transform": transform,
            "nodata": self.nodata,
            "tiled": True,
            "blockxsize": self.block_cols,
            "blockysize": self.block_rows,
            "compress": "deflate",
        }

    def block_window(self, row: int, col: int) -> Window:
        r0, c0 = row * self.block_rows, col * self.block_cols
        return Window(c0, r0, min(self.block_cols, self.width - c0), min(self.block_rows, self.height - r0))

    def empty_block(self, row: int, col: int) -> np.ndarray:
        window = self.block_window(row, col)
        block = np.empty((self.count, window.height, window.width), dtype=self.dtype)
        block[:] = self.empty[:, None, None]
        return block

    def holds(self, window: Window) -> bool:
        """Whether the parts hold every block ``window`` touches (its pixels are final in them)."""
        rows, cols, _ = covered_pixels(window, self.shape, self.block_rows, self.block_cols)
        return bool(self.saved[rows, cols].all())

    def expect(self, windows: Iterable[Window]) -> None:
        """The disjoint windows the pieces to come will cover: blocks they do not touch, and the parts do not
        hold, are written now, with no data."""
        for window in windows:
            rows, cols, pixels = covered_pixels(window, self.shape, self.block_rows, self.block_cols)
            self.missing[rows, cols] += pixels
        self.missing[self.written] = 0  # the parts' blocks are final
        for row, col in zip(*np.nonzero((self.missing == 0) & ~self.written), strict=True):
            self._write_block(int(row), int(col), self.empty_block(int(row), int(col)), keep=False)

    def put(self, window: Window, data: np.ndarray) -> None:
        """A finished piece: (bands, height, width) of the raster's dtype at ``window``."""
        rows, cols, _ = covered_pixels(window, self.shape, self.block_rows, self.block_cols)
        for row in range(rows.start, rows.stop):
            for col in range(cols.start, cols.stop):
                if self.written[row, col]:
                    continue  # held by a part: the same pixels
                block = self.block_window(row, col)
                common = intersection(window, block)
                assert common is not None, "covered_pixels gives the blocks the window overlaps"
                buffer = self.buffers.get((row, col))
                if buffer is None:
                    buffer = self.buffers[row, col] = self.empty_block(row, col)
                in_block, in_window = overlap_slices(common, block), overlap_slices(common, window)
                buffer[(slice(None), *in_block)] = data[(slice(None), *in_window)]
                self.missing[row, col] -= common.height * common.width
                if self.missing[row, col] == 0:
                    self._write_block(row, col, self.buffers.pop((row, col)), keep=True)

    def _write_block(self, row: int, col: int, block: np.ndarray, keep: bool) -> None:
        with self._writing():
            self._dst.write(block, window=self.block_window(row, col))
        self.written[row, col] = True
        if keep and self.keep_unsaved:
            self.unsaved.append((row, col, block))

    @property
    def pending_bytes(self) -> int:
        """Bytes of blocks partly filled and of blocks kept for the next part."""
        return sum(b.nbytes for b in self.buffers.values()) + self.unsaved_bytes()

    def unsaved_bytes(self) -> int:
        return sum(block.nbytes for _, _, block in self.unsaved)

    def save_part(self, path: str | Path) -> int:
        """Write the blocks written since the previous part as a part, atomically at ``path``; how many (0: none,
        and no file)."""
        if not self.unsaved:
            return 0
        profile = {
            "driver": "GTiff",
            "width": self.block_cols,
            "height": self.block_rows * len(self.unsaved),
            "count": self.count,
            "dtype": self.dtype.name,
            "blockysize": self.block_rows,
            # fast: blending 275 tiles of 400 px took 1.55 s, 2.4 s with deflate parts, 1.7 s with zstd level 1
            "compress": "zstd",
            "zstd_level": 1,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)  # a stack of blocks, not a map
            with atomic_path(path, silent_failures=True) as tmp, rasterio.open(tmp, "w", **profile) as part:
                part.update_tags(**{BLOCKS_TAG: json.dumps([[row, col] for row, col, _ in self.unsaved])})
                for k, (_, _, block) in enumerate(self.unsaved):
                    part.write(block, window=Window(0, k * self.block_rows, block.shape[2], block.shape[1]))
        for row, col, _ in self.unsaved:
            self.saved[row, col] = True
        count, self.unsaved = len(self.unsaved), []
        return count

    def _copy_part(self, path: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as part:
                blocks = json.loads(part.tags().get(BLOCKS_TAG, "null") or "null")
                if (
                    not isinstance(blocks, list)
                    or (part.width, part.count) != (self.block_cols, self.count)
                    or part.height != self.block_rows * len(blocks)
                ):
                    raise ValueError(f"{path}: not a part of this rank raster (size, bands or blocks differ)")
                for k, (row, col) in enumerate(blocks):
                    window = self.block_window(row, col)
                    block = part.read(window=Window(0, k * self.block_rows, window.width, window.height))
                    self._write_block(row, col, block, keep=False)
                    self.saved[row, col] = True

    def close(self) -> None:
        """Move the raster into place; raises (and writes nothing) when a block is not complete."""
        if not self.written.all():
            incomplete = np.argwhere(~self.written)
            self.abort()
            raise RuntimeError(
                f"{len(incomplete)} blocks of the rank raster incomplete (first {incomplete[0].tolist()})"
            )
        with self._writing():
            self._dst.close()  # GDAL may lose a failed write here without raising: silent_failures
            move_into_place(self._tmp, self.path, silent_failures=True)
        self.closed = True

    def abort(self) -> None:
        """Write nothing at the final path (the temporary removed)."""
        if not self.closed:
            self.closed = True
            if self._dst is not None:
                with contextlib.suppress(Exception):  # what it could not write is thrown away
                    self._dst.close()
            self._tmp.unlink(missing_ok=True)


# --- merging rank rasters ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def scratch_path(near: Path, name: str) -> Iterator[Path]:
    """A temporary file next to ``near`` (same file system), removed afterwards whatever happens; a full file system
    on the way is a DiskFullError naming ``near`` (:func:`rasterscale.atomic.writing`)."""
    path = near.with_name(f".{near.stem}.{name}-{os.getpid()}.tif")
    try:
        with writing(near):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield path
    finally:
        path.unlink(missing_ok=True)


def rank_window(src: rasterio.io.DatasetReader, scene: rasterio.io.DatasetReader, path: str | Path) -> Window:
    """Where a rank raster lies in the scene's pixel grid; one that is not on the grid fails naming the file."""
    t, s = src.transform, scene.transform
    col, row = (t.c - s.c) / s.a, (t.f - s.f) / s.e
    if (
        src.crs != scene.crs
        or not np.allclose((t.a, t.b, t.d, t.e), (s.a, s.b, s.d, s.e))
        or abs(col - round(col)) > 1e-6
        or abs(row - round(row)) > 1e-6
    ):
        raise ValueError(f"{path}: rank raster is not on the scene's pixel grid (CRS, resolution or offset)")
    window = Window(round(col), round(row), src.width, src.height)
    if (
        window.col_off < 0
        or window.row_off < 0
        or window.col_off + window.width > scene.width
        or window.row_off + window.height > scene.height
    ):
        raise ValueError(f"{path}: rank raster reaches outside the scene ({window} in {scene.width}x{scene.height})")
    return window


def open_merge_sources(
    stack: contextlib.ExitStack,
    raster_path: str | Path,
    rank_rasters: Sequence[str | Path],
    cache_mb: int,
    bands: tuple[int, str] | None,
) -> tuple[rasterio.io.DatasetReader, list[tuple[str, rasterio.io.DatasetReader, Window]]]:
    """What a scene's merge reads, opened in ``stack`` under a GDAL block cache of ``cache_mb`` MB: the scene's
    raster, and each rank raster as (its path, its reader, its window on the scene: :func:`rank_window`).
    ``bands``: how many bands a rank raster must have, and what they are for the error (None: not checked)."""
    stack.enter_context(rasterio.Env(GDAL_CACHEMAX=cache_mb * 2**20))
    scene = stack.enter_context(open_raster(raster_path))
    ranks = []
    for path in rank_rasters:
        src = stack.enter_context(rasterio.open(path))
        if bands is not None and src.count != bands[0]:
            raise ValueError(f"{path}: {src.count} bands, expected {bands[1]}")
        ranks.append((str(path), src, rank_window(src, scene, path)))
    return scene, ranks


def window_valid_mask(src: rasterio.io.DatasetReader, spec: ImageSpec, window: Window) -> np.ndarray | None:
    """Valid pixels of a window under the spec's mask (None: all valid); reads the mask alone where it is a band
    or GDAL's mask, the bands for a nodata value or float pixels."""
    floats = any(np.dtype(src.dtypes[band - 1]).kind == "f" for band in spec.bands)
    if spec.mask == "none" and not floats:
        return None
    with decoding(src.name, window):
        if spec.mask == "alpha" and not floats:
            return src.read(spec.alpha, window=window) > 0
        if spec.mask == "dataset" and not floats:
            return src.dataset_mask(window=window) > 0
    return read_masked(src, spec, window=window)[1]


def claimed_pieces(
    ranks: Sequence[tuple[str, rasterio.io.DatasetReader, Window]],
    window: Window,
    claims: Callable[[np.ndarray], np.ndarray],
    **read: Any,
) -> Iterator[tuple[rasterio.io.DatasetReader, Window, slice, slice, np.ndarray, np.ndarray]]:
    """Each rank raster's piece of a merge block ``window``: (its reader, the piece's window in it, the block's rows
    and columns it covers, its pixels read with ``read``, the pixels it claims by ``claims(pixels)``). A pixel two
    rank rasters claim raises ValueError naming both."""
    owner = np.full((int(window.height), int(window.width)), -1, dtype=np.int32)
    for index, (path, src, rank) in enumerate(ranks):
        common = intersection(window, rank)
        if common is None:
            continue
        inside = Window(common.col_off - rank.col_off, common.row_off - rank.row_off, common.width, common.height)
        rows = slice(common.row_off - window.row_off, common.row_off - window.row_off + common.height)
        cols = slice(common.col_off - window.col_off, common.col_off - window.col_off + common.width)
        data = src.read(window=inside, **read)
        claimed = claims(data)
        clash = claimed & (owner[rows, cols] >= 0)
        if clash.any():
            r, c = (int(v[0]) for v in np.nonzero(clash))
            other = ranks[owner[rows, cols][r, c]][0]
            raise ValueError(
                f"pixel (row {common.row_off + r}, col {common.col_off + c}) claimed by two rank rasters: "
                f"{other} and {path}"
            )
        owner[rows, cols][claimed] = index
        yield src, inside, rows, cols, data, claimed


def block_windows(width: int, height: int, block: int) -> list[Window]:
    return [
        Window(col, row, min(block, width - col), min(block, height - row))
        for row in range(0, height, block)
        for col in range(0, width, block)
    ]


def write_project_mosaic(job: Mapping[str, Any], layer: str, task: str) -> int:
    """A project's ``layer`` at ``job["outputs"][layer]``: a VRT over the scenes' merged rasters of it, then the
    seams' (drawn over the scenes' where they predicted, their nodata left out); returns how many rasters it
    draws. The scenes must share a CRS (a VRT has one; ``task`` names the project's task in the error)."""
    crs = {source["crs"] for source in job["sources"] if "crs" in source}
    if len(crs) > 1:
        raise InputError(f"project: the scenes are in {len(crs)} CRSs; a {task} project's VRT needs one")
    ordered = sorted(job["sources"], key=lambda source: is_seam(source["name"]))
    write_mosaic(job["outputs"][layer], [source[layer] for source in ordered])
    return len(ordered)
