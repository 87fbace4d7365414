"""Blending overlapping tile predictions into one rank's class raster, with memory that does not grow with the raster.

Every tile of the manifest owns a *core*: along each axis, the boundary between consecutive tiles is the middle of
their overlap, so the cores partition the raster (:func:`tile_cores`; tiles left out of the manifest leave their
cores out, and those pixels are masked anyway). A rank writes the class of the pixels in its own tiles' cores. A
core's class is the argmax of the weighted mean of the probabilities of every tile whose window intersects the core
(:func:`halo_tiles` lists them: the rank predicts its own tiles and this halo); a tile's weight falls as sin² towards
its inner edges, where a model sees least context (:func:`edge_weights`).

:class:`TileBlender` takes the tiles' probabilities in manifest order. Each own core is cut in two where the next
row of tiles begins (:func:`core_pieces`): the upper piece is finished by the tiles of its own row, the lower piece
(half an overlap high) waits for the row below. A piece's weighted sum is kept from its own tile to its last
contributor (earlier tiles' slivers of overlap are kept as they are until then), so what waits for the next row
is the lower pieces: half an overlap of rows across the rank's width, not a row of tiles. Pieces whose next tile
is far ahead wait on disk (:class:`SpilledPieces`), so the rank's memory does not grow with that width either.
A finished piece goes
straight into the rank raster (:class:`~rasterscale.tasks.segmentation.rankraster.RankRaster`), which writes each block
of it once every piece covering the block is in: no row of the raster is ever held whole. Sums run over the
contributors in manifest order, so a pixel's class is the same whichever rank owns it.

Written blocks are final data, so they are also what a rank saves (:meth:`TileBlender.save_part`: a part
of the blocks written since the previous one, and the own tiles whose cores the parts now hold entirely). A
blender resumed from such parts copies their blocks into its raster first and blends only the cores they do not
hold entirely (never writing a block of the parts again).
"""

from __future__ import annotations

import os
import pickle
import shutil
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from affine import Affine
from rasterio.windows import Window

from rasterscale.grid.tile import Tile
from rasterscale.raster.windows import bounding_window, intersection, overlap_slices, tile_window, windows_intersect
from rasterscale.tasks.segmentation.rankraster import BLOCK_ROWS, RankRaster

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


class TileGrid:
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
    grid = TileGrid(all_tiles)
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


class SpilledPieces:
    """The blend state (sums, slivers) of pieces whose next contributor is far ahead, on disk: one file per
    piece, read back (and removed) when that tile comes. Row after row, these are the pieces of the overlap
    between two rows of tiles, which span the raster's width: spilled, they leave the rank's memory flat however
    wide the raster is."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pieces: set[int] = set()
        self.written_bytes = 0

    def __contains__(self, piece: int) -> bool:
        return piece in self.pieces

    def _path(self, piece: int) -> Path:
        return self.folder / f"{piece}.pickle"

    def put(self, piece: int, state: object) -> None:
        self.folder.mkdir(exist_ok=True)
        with open(self._path(piece), "wb") as handle:
            pickle.dump(state, handle, protocol=pickle.HIGHEST_PROTOCOL)
            self.written_bytes += handle.tell()
        self.pieces.add(piece)

    def take(self, piece: int) -> Any:
        path = self._path(piece)
        with open(path, "rb") as handle:
            state = pickle.load(handle)
        path.unlink()
        self.pieces.discard(piece)
        return state

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.pieces.clear()


class TileBlender:
    """One rank's blended class raster (see the module docstring). Feed :meth:`add` every tile of
    ``tiles_to_predict`` (own and halo tiles, :func:`halo_tiles`) in that order, then :meth:`close`.

    The rank raster (:class:`~rasterscale.tasks.segmentation.rankraster.RankRaster`) covers the bounding window of the
    own cores: band 1 the class ids (:data:`NODATA_CLASS` elsewhere), and with ``probabilities`` bands 2..C+1 the
    blended probabilities as round(p * 255) (band scale 1/255). It is written block by block, atomically; GDAL's
    block cache bound is the caller's (:func:`rasterscale.datasets.tiles.limit_read_cache`). A rank without own tiles
    writes one pixel of no data.

    ``parts``: parts an earlier run of the rank wrote (:meth:`save_part`), copied first; the own cores they hold
    entirely are not blended again. ``keep_unsaved``: keep the blocks written since the last part, for
    :meth:`save_part`. ``spill_ahead``: a piece whose next contributor is more tiles ahead waits on disk
    (:class:`SpilledPieces`).
    """

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
        spill_ahead: int = SPILL_AHEAD,
    ) -> None:
        self.tiles = list(tiles_to_predict)
        self.spill_ahead = spill_ahead
        self.width, self.height, self.num_classes, self.taper = width, height, num_classes, taper
        self.cores, self.probabilities = cores, probabilities
        self.own_ids = set(own_ids)
        self.window = bounding_window(cores[i] for i in self.own_ids) or Window(0, 0, 1, 1)
        self.raster = RankRaster(
            out_path,
            self.window.width,
            self.window.height,
            transform @ Affine.translation(self.window.col_off, self.window.row_off),
            crs,
            num_classes if probabilities else 0,
            parts,
            keep_unsaved,
            block_rows,
        )
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
        except BaseException as err:
            self.raster.abort(type(err))
            self.closed = True
            raise
        self.remaining, self.contributors, self.targets = self._contributors()
        self.next_index = 0
        self.sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # piece -> (Σ w·p (C,h,w), Σ w (h,w))
        self.slivers: dict[int, list] = {}  # piece -> contributions of earlier tiles, kept until its own tile comes
        self.spilled = SpilledPieces(spill_folder(out_path))  # pieces waiting for a tile far ahead
        self.peak_pending_bytes = 0

    def _local(self, window: Window) -> Window:
        """A window of the scene in the rank raster's pixels."""
        return Window(
            window.col_off - self.window.col_off, window.row_off - self.window.row_off, window.width, window.height
        )

    def _contributors(self) -> tuple[dict[int, int], dict[int, list[int]], dict[int, list[int]]]:
        """Per piece of an own core, how many tiles intersect it, and their places in ``tiles``; per tile, the
        pieces it contributes to."""
        grid = TileGrid(self.tiles)
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

    def add(self, tile_id: int, probs: np.ndarray) -> None:
        """A tile's softmax probabilities, (C, h, w) float32; tiles come in ``tiles_to_predict`` order."""
        if self.next_index >= len(self.tiles) or self.tiles[self.next_index].tile_id != tile_id:
            expected = self.tiles[self.next_index].tile_id if self.next_index < len(self.tiles) else None
            raise ValueError(f"tile {tile_id} added out of order (expected {expected})")
        tile = self.tiles[self.next_index]
        if probs.shape != (self.num_classes, tile.height, tile.width):
            raise ValueError(
                f"tile {tile_id}: probabilities of shape {probs.shape}, "
                f"expected {(self.num_classes, tile.height, tile.width)}"
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
            self._accumulate(piece, tile, probs, weights)
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
        for piece in targets:
            self.remaining[piece] -= 1
            if self.remaining[piece] == 0:
                self._finish_piece(piece)
            elif self._next_contributor(piece) - place > self.spill_ahead:
                self._spill(piece)

    def _spill(self, piece: int) -> None:
        """A piece's sums or slivers to disk until its next contributor comes."""
        self.spilled.put(piece, (self.sums.pop(piece, None), self.slivers.pop(piece, None)))

    def _restore(self, piece: int) -> None:
        sums, slivers = self.spilled.take(piece)
        if sums is not None:
            self.sums[piece] = sums
        if slivers is not None:
            self.slivers[piece] = slivers

    def _accumulate(self, piece: int, tile: Tile, probs: np.ndarray, weights: np.ndarray) -> None:
        """Add a tile's weighted probabilities to a piece of an own core. Until the core's own tile comes, the
        contributions of earlier tiles (slivers of their overlap) are kept as they are and summed, in order, when
        it does: a piece's sums are then held from its own tile to its last contributor only."""
        own_id, core = self.pieces[piece]
        common = intersection(tile_window(tile), core)
        assert common is not None, "a tile's targets are the pieces it overlaps"
        in_tile, in_core = overlap_slices(common, tile_window(tile)), overlap_slices(common, core)
        tile_weights = weights[in_tile]
        contribution = (in_core, probs[(slice(None), *in_tile)] * tile_weights, tile_weights)
        if piece not in self.sums:
            if tile.tile_id != own_id and self.remaining[piece] > 1:
                self.slivers.setdefault(piece, []).append((in_core, contribution[1], tile_weights.copy()))
                return
            shape = (int(core.height), int(core.width))
            self.sums[piece] = (
                np.zeros((self.num_classes, *shape), dtype=np.float32),
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
        """A piece's classes (and probabilities) into the rank raster."""
        acc, weight_sum = self.sums.pop(piece)
        _, window = self.pieces[piece]
        data = np.empty((self.raster.count, window.height, window.width), dtype=np.uint8)
        data[0] = np.argmax(acc, axis=0)
        if self.probabilities:
            data[1:] = np.rint(np.clip(acc / weight_sum, 0.0, 1.0) * 255.0)
        self.raster.put(self._local(window), data)

    def unsaved_bytes(self) -> int:
        return self.raster.unsaved_bytes()

    def save_part(self, path: str | Path) -> tuple[list[int], int] | None:
        """Write the blocks of the rank raster written since the previous part as a part, atomically at
        ``path``; the own tile ids whose cores are now all in parts, and the part's number of blocks. None when
        no block was written since."""
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

    def __enter__(self) -> TileBlender:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.closed:
            return
        if kind is None:
            self.close()
        else:
            self.spilled.clear()
            self.raster.abort(kind)
            self.closed = True
