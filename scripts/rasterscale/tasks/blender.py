"""The torch half of blending (:mod:`rasterscale.tasks.blending` says what a blend is): a band of weighted sums on
the rank's device, cut into column chunks; finished rows of a chunk made into the rank raster's bands on the device
and handed to a writer thread; chunks waiting beyond a bound on disk.

The band covers the columns of the tiles a rank predicts, cut where the cores' columns are cut, into chunks of at
least :data:`CHUNK_COLS` px (:func:`band_chunks`). A tile adds its weighted values and its weights (one tensor of C + 1
channels: Σ w·v, and Σ w where the task's bands need it, :attr:`Blender.weighed`) to the chunks it overlaps, a
tile's height of rows each. Tiles come row of tiles after row
of tiles, so every row of the raster above where the next row of tiles begins is final once the current row of tiles
has gone past a chunk: the chunk's final rows become the raster's bands there (:meth:`Blender.finish`: an argmax, a
mean) and go to the writer (:class:`~rasterscale.tasks.piecewriter.PieceWriter`, which copies them to the host without
waiting and puts them into the rank raster from a thread of its own), the pixels of the rank's own cores only. On a
CPU the writer thread may finish them too, beside the main thread (:attr:`Blender.finished_by_writer`). A
chunk then keeps only the rows that the next row of tiles still adds to (an overlap's), until that row reaches it.

What the band holds is, at most, the chunks the current tile overlaps at a tile's height, and an overlap's rows across
the rank's width: on a wide raster, beyond ``blend_mb`` MB, the waiting chunks needed last (the rightmost) go to disk
(:class:`SpilledChunks`) and come back when the next row of tiles reaches them. Sums run over the tiles in manifest
order from zero, as the raster-wide sum would: a pixel's value is the same whichever rank owns it, on any device
(within float rounding on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from abc import ABC, abstractmethod
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np
import torch
from rasterio.windows import Window

from rasterscale.atomic import writing
from rasterscale.grid.tile import Tile
from rasterscale.raster.windows import bounding_window
from rasterscale.tasks.blending import BlendLayout, BlockRaster, RasterSite, edge_weights, spill_folder
from rasterscale.tasks.piecewriter import PieceWriter, Placement

Rect = tuple[int, int, int, int]  # rows [r0, r1), columns [c0, c1) of the scene

BLEND_MB = 256.0  # default bound of a rank's band (predict.blend_mb): waiting chunks beyond it wait on disk
STACKS_KEPT = 8  # batches of tile kinds whose stacked weights are kept
CHUNK_COLS = 1024  # the narrowest chunk of the band, in px (a chunk's rows are finished, and written, at once)


@dataclass
class Chunk:
    """A column chunk of the band: its columns [left, right) of the scene, the rank's own cores in it (merged
    rectangles, :func:`own_rectangles`), and its sums (C + 1, rows, width) from row ``top`` (None: none held)."""

    left: int
    right: int
    own: list[Rect] = field(default_factory=list)
    tops: list[int] = field(default_factory=list)  # each own rectangle's first row (bisected)
    top: int = 0
    sums: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.sums is None else int(self.sums.shape[1])


def band_chunks(cores: Mapping[int, Window], tiles: Sequence[Tile], chunk_cols: int = CHUNK_COLS) -> list[Chunk]:
    """The band's chunks over the columns of ``tiles``, cut where cores' columns begin, each at least
    ``chunk_cols`` wide (the last one may be narrower)."""
    if not tiles:
        return []
    left = min(t.col_off for t in tiles)
    right = max(t.col_off + t.width for t in tiles)
    cuts = sorted({int(core.col_off) for core in cores.values()} | {left, right})
    cuts = [cut for cut in cuts if left <= cut <= right]
    chunks, start = [], left
    for cut in cuts[1:]:
        if cut - start >= chunk_cols or cut == right:
            chunks.append(Chunk(start, cut))
            start = cut
    return chunks


def own_rectangles(chunks: Sequence[Chunk], cores: Iterable[Window]) -> None:
    """Give each chunk the cores in it (``cores``: the rank's own, not yet in a part), as rectangles (row0, row1,
    col0, col1) with the cores of one row of cores side by side merged, sorted by row."""
    lefts = [chunk.left for chunk in chunks]
    for core in sorted(cores, key=lambda c: (c.row_off, c.col_off)):
        chunk = chunks[bisect_right(lefts, core.col_off) - 1]
        r0, c0 = int(core.row_off), int(core.col_off)
        r1, c1 = r0 + int(core.height), c0 + int(core.width)
        if chunk.own and chunk.own[-1][0:2] == (r0, r1) and chunk.own[-1][3] == c0:
            chunk.own[-1] = (r0, r1, chunk.own[-1][2], c1)
        else:
            chunk.own.append((r0, r1, c0, c1))
    for chunk in chunks:
        chunk.tops = [rect[0] for rect in chunk.own]


class SpilledChunks:
    """The sums of waiting chunks on disk, one ``.npz`` of plain arrays per chunk (read back with
    ``allow_pickle=False``, and removed), until the next row of tiles reaches them: what the band holds beyond its
    bound (``predict.blend_mb``), so that however wide the raster, the rank's memory stays within it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.chunks: set[int] = set()
        self.written_bytes = 0

    def __contains__(self, chunk: int) -> bool:
        return chunk in self.chunks

    def _path(self, chunk: int) -> Path:
        return self.folder / f"{chunk}.npz"

    def put(self, chunk: int, sums: torch.Tensor) -> None:
        self.folder.mkdir(exist_ok=True)
        with open(self._path(chunk), "wb") as handle:
            np.savez(handle, sums=sums.cpu().numpy())
            self.written_bytes += handle.tell()
        self.chunks.add(chunk)

    def take(self, chunk: int, device: torch.device) -> torch.Tensor:
        path = self._path(chunk)
        with np.load(path, allow_pickle=False) as stored:
            sums = torch.from_numpy(stored["sums"]).to(device)
        path.unlink()
        self.chunks.discard(chunk)
        return sums

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.chunks.clear()


class EdgeWeights:
    """Each tile's :func:`edge_weights` as a (1, h, w) tensor on the device, made once per kind of tile (its size
    and which of its edges are inner: a grid has at most nine kinds)."""

    def __init__(self, width: int, height: int, taper: int, device: torch.device) -> None:
        self.width, self.height, self.taper, self.device = width, height, taper, device
        self.made: dict[tuple[int, ...], torch.Tensor] = {}
        self.batches: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}

    def key(self, tile: Tile) -> tuple[int, ...]:
        """A tile's kind: its size, and which of its edges are inner."""
        return (
            tile.height,
            tile.width,
            tile.row_off > 0,
            tile.row_off + tile.height < self.height,
            tile.col_off > 0,
            tile.col_off + tile.width < self.width,
        )

    def of(self, tile: Tile) -> torch.Tensor:
        key = self.key(tile)
        if key not in self.made:
            weights = edge_weights(tile, self.width, self.height, self.taper)
            self.made[key] = torch.from_numpy(weights)[None].to(self.device)
        return self.made[key]

    def clear(self) -> None:
        """Let every weight made go (they are made again if asked for)."""
        self.made.clear()
        self.batches.clear()

    def stacked(self, tiles: Sequence[Tile]) -> torch.Tensor:
        """(B, 1, h, w): the weights of a batch of tiles of one size (the last few batches' kinds kept: a raster's
        rows of tiles make the same batches over and over)."""
        kinds = tuple(self.key(tile) for tile in tiles)
        if kinds not in self.batches:
            if len(self.batches) >= STACKS_KEPT:
                self.batches.pop(next(iter(self.batches)))
            self.batches[kinds] = torch.stack([self.of(tile) for tile in tiles])
        return self.batches[kinds]


class Blender(ABC):
    """One rank's blended raster (see the module docstring). Feed :meth:`add_batch` (or :meth:`add`) every tile of
    the layout's ``tiles_to_predict`` (own and halo tiles, :func:`~rasterscale.tasks.blending.halo_tiles`) in that
    order, then :meth:`close`. A task says what its raster is (:meth:`open_raster`) and what finished sums become in
    it (:meth:`finish`).

    The sums live on ``device`` (the rank's: a GPU's memory, or the host's), at most ``blend_mb`` MB of waiting
    chunks (the rest on disk). The rank raster (a :class:`~rasterscale.tasks.blending.BlockRaster` at ``site``,
    whose transform is the scene's) covers the bounding window of the own cores, and holds the raster's empty value
    elsewhere. It is written block by block, atomically, by the writer thread; GDAL's block cache bound is the
    caller's (:func:`rasterscale.datasets.tiles.limit_read_cache`). A rank without own tiles writes one empty pixel.

    ``channels``: the values per pixel of a tile (C of :meth:`add`). The site's ``parts``: parts an earlier run of
    the rank wrote (:meth:`save_part`), copied first; the own cores they hold entirely are not blended again. Its
    ``keep_unsaved``: keep the blocks written since the last part, for :meth:`save_part`.
    """

    def __init__(
        self,
        layout: BlendLayout,
        channels: int,
        site: RasterSite,
        blend_mb: float = BLEND_MB,
        device: torch.device | str = "cpu",
    ) -> None:
        self.tiles = list(layout.tiles_to_predict)
        self.device = torch.device(device)
        self.bound = blend_mb * 2**20
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
            self.raster.expect(self._local(cores[i]) for i in own_ids)
        except BaseException:
            self.raster.abort()
            self.closed = True
            raise
        self.chunks = band_chunks(cores, self.tiles)
        own_rectangles(self.chunks, [cores[i] for i in own_ids])
        self.lefts = [chunk.left for chunk in self.chunks]
        self.row_starts = sorted({t.row_off for t in self.tiles})
        self.band_rows = max((t.height for t in self.tiles), default=0)
        self.next_index = 0
        self.active: list[int] = []  # chunks the current row of tiles has reached and not gone past
        self.free: dict[tuple[int, ...], list[torch.Tensor]] = {}  # bands let go, by shape (as many as were active)
        self.held = 0  # bytes of sums on the device
        self.spilled = SpilledChunks(spill_folder(site.path))
        self.weights = EdgeWeights(self.width, self.height, self.taper, self.device)
        self.peak_pending_bytes = 0  # the most the band held (the rank raster's blocks are the writer thread's)
        self.writer = PieceWriter(self.raster.put, self.device, Path(site.path).name)

    @abstractmethod
    def open_raster(self, site: RasterSite, width: int, height: int) -> BlockRaster:
        """The rank raster: ``width`` x ``height`` px at ``site`` (resumed from its parts)."""

    #: Whether a CPU rank's writer thread finishes the rows, beside the main thread, instead of the main thread
    #: between two batches: worth it for a finish of several passes (segmentation's argmax and probabilities: the
    #: null model's job 569 -> 624 tiles/s), not for one division (a mean's: 654 -> 632, medians of 8 on 2 cores).
    finished_by_writer = False

    @property
    def weighed(self) -> bool:
        """Whether :meth:`finish` needs the sum of the weights (a mean does, an argmax does not): without it the band
        holds C channels instead of C + 1."""
        return True

    @abstractmethod
    def finish(self, weighted: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """Finished pixels' bands in the rank raster (``raster.count``, h, w), of its dtype, from their sums: Σ w·v
        (C, h, w) and Σ w (h, w; None unless :attr:`weighed`), float32 on the device."""

    def _local(self, window: Window) -> Window:
        """A window of the scene in the rank raster's pixels."""
        return Window(
            window.col_off - self.window.col_off, window.row_off - self.window.row_off, window.width, window.height
        )

    def add(self, tile_id: int, values: np.ndarray | torch.Tensor) -> None:
        """One tile's values, (C, h, w) float32 (:meth:`add_batch` of one)."""
        self.add_batch([tile_id], torch.as_tensor(values)[None])

    def add_batch(self, tile_ids: Sequence[int], values: torch.Tensor) -> None:
        """A batch of tiles' values, (B, C, h, w) float32 on the device; tiles come in ``tiles_to_predict`` order."""
        tiles = self._next_tiles(tile_ids, tuple(values.shape))
        weights = self.weights.stacked(tiles)
        values = values.to(self.device)
        product = torch.empty(values.shape[1:], device=self.device)  # one tile's w·v at a time (in cache)
        with self._writing():
            for k, tile in enumerate(tiles):
                torch.mul(values[k], weights[k], out=product)
                self._add_tile(tile, product, weights[k])
            self.writer.raise_failure()

    def _next_tiles(self, tile_ids: Sequence[int], shape: tuple[int, ...]) -> list[Tile]:
        """The tiles of a batch, checked: the next ones in order, of the batch's shape."""
        tiles = self.tiles[self.next_index : self.next_index + len(tile_ids)]
        for k, tile_id in enumerate(tile_ids):
            if k >= len(tiles) or tiles[k].tile_id != tile_id:
                expected = tiles[k].tile_id if k < len(tiles) else None
                raise ValueError(f"tile {tile_id} added out of order (expected {expected})")
            if shape[1:] != (self.channels, tiles[k].height, tiles[k].width):
                expected_shape = (self.channels, tiles[k].height, tiles[k].width)
                raise ValueError(f"tile {tile_id}: values of shape {shape[1:]}, expected {expected_shape}")
        return tiles

    def _add_tile(self, tile: Tile, product: torch.Tensor, weights: torch.Tensor) -> None:
        """A tile's w·v (``product``, (C, h, w): its values times its ``weights``, rounded as the raster-wide sum
        rounds them, before the sum) and w (1, h, w) into the chunks it overlaps; chunks the row has gone past, and
        at a new row of tiles every chunk, give their finished rows to the writer."""
        if self.next_index and tile.row_off != self.tiles[self.next_index - 1].row_off:
            self._end_row(tile.row_off)
        self.next_index += 1
        limit = self._next_row_start(tile.row_off)
        for index in list(self.active):
            if self.chunks[index].right <= tile.col_off:  # the row has gone past it
                self.active.remove(index)
                self._finish_rows(index, limit)
        first = bisect_right(self.lefts, tile.col_off) - 1
        for index in range(first, len(self.chunks)):
            chunk = self.chunks[index]
            if chunk.left >= tile.col_off + tile.width:
                break
            self._reach(index, tile.row_off)
            c0, c1 = max(chunk.left, tile.col_off), min(chunk.right, tile.col_off + tile.width)
            rows = slice(tile.row_off - chunk.top, tile.row_off - chunk.top + tile.height)
            assert chunk.sums is not None, "a reached chunk holds its sums"
            sums = chunk.sums[:, rows, c0 - chunk.left : c1 - chunk.left]
            cols = slice(c0 - tile.col_off, c1 - tile.col_off)
            # add_, not +=: Python's `x[i] += y` also assigns x[i] back, a copy of the sums onto themselves
            sums[: self.channels].add_(product[:, :, cols])
            if self.weighed:
                sums[self.channels :].add_(weights[:, :, cols])
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.held)
        if self.held > self.bound:
            self._spill_beyond_bound()
        if self.next_index == len(self.tiles):
            self._end_row(None)
            self._let_go()

    def _let_go(self) -> None:
        """The last tile is in: the bands kept for reuse and the weights made go (on a GPU, device memory beyond
        ``blend_mb``), so that a job's scenes, each open until the job writes them all, do not each keep theirs."""
        self.free.clear()
        self.weights.clear()

    def _next_row_start(self, row_off: int) -> int | None:
        """The first row of the next row of tiles after the one at ``row_off`` (None: it is the last)."""
        after = bisect_right(self.row_starts, row_off)
        return self.row_starts[after] if after < len(self.row_starts) else None

    def _reach(self, index: int, row_off: int) -> None:
        """The current row of tiles (from ``row_off``) reaches a chunk: its sums hold a tile's height of rows from
        there, what waits of them (brought back from disk if need be) at the top; rows of it above are finished."""
        if index in self.active:
            return
        chunk = self.chunks[index]
        if index in self.spilled:
            chunk.sums = self.spilled.take(index, self.device)
            self.held += chunk.sums.nbytes
        if chunk.sums is not None and chunk.top < row_off:
            self._finish_rows(index, row_off)
        sums = self._band((self.channels + self.weighed, self.band_rows, chunk.right - chunk.left))
        if chunk.sums is not None:
            sums[:, : chunk.rows] = chunk.sums
            self.held -= chunk.sums.nbytes
        chunk.sums, chunk.top = sums, row_off
        self.held += sums.nbytes
        self.active.append(index)

    def _end_row(self, next_start: int | None) -> None:
        """A row of tiles is done: every chunk's rows above ``next_start`` (None: all) are finished; waiting chunks
        beyond the bound go to disk."""
        self.active = []
        for index, chunk in enumerate(self.chunks):
            if chunk.sums is not None:
                self._finish_rows(index, next_start)
            elif index in self.spilled and next_start is None:  # waiting on disk for a row that never came
                chunk.sums = self.spilled.take(index, self.device)
                self.held += chunk.sums.nbytes
                self._finish_rows(index, None)
        if self.held > self.bound:
            self._spill_beyond_bound()

    def _finish_rows(self, index: int, limit: int | None) -> None:
        """A chunk's rows above ``limit`` (None: all) are final: their bands (:meth:`finish`) go to the writer, for
        the own cores' pixels; the chunk keeps the rest (a copy: the band's memory goes)."""
        chunk = self.chunks[index]
        assert chunk.sums is not None
        done = chunk.rows if limit is None else max(0, min(chunk.rows, limit - chunk.top))
        if done == 0:
            return
        placements = self._placements(chunk, done)
        band = chunk.sums
        handed = bool(placements) and self.device.type == "cpu" and self.finished_by_writer
        if placements:
            if handed:  # the writer thread finishes them beside the main thread (which goes on), then writes them
                self.writer.submit_unfinished(band, functools.partial(self._finished, done=done, free=True), placements)
            else:  # on the device, then copied to the host without waiting
                self.writer.submit(self._finished(band, done), placements)
        self.held -= band.nbytes
        if done < chunk.rows:
            chunk.sums, chunk.top = band[:, done:].clone(), chunk.top + done
            self.held += chunk.sums.nbytes
        else:
            chunk.sums, chunk.top = None, chunk.top + done
        if band.shape[1] == self.band_rows and not handed:
            self.free.setdefault(tuple(band.shape), []).append(band)

    def _finished(self, sums: torch.Tensor, done: int, free: bool = False) -> torch.Tensor:
        """The raster's bands of the first ``done`` rows of a chunk's sums (:meth:`finish`); ``free``: the sums are
        a band that is let go then, for the main thread to reuse (the writer thread's finish: the main thread has
        taken what it keeps of them before it asks for a band again)."""
        weights = sums[self.channels, :done] if self.weighed else None
        bands = self.finish(sums[: self.channels, :done], weights)
        if free and sums.shape[1] == self.band_rows and self.next_index < len(self.tiles):
            self.free.setdefault(tuple(sums.shape), []).append(sums)  # list.append and pop: atomic under the GIL
        return bands

    def _band(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """Zeroed sums of a chunk reached by a row of tiles: a band let go earlier, or a new one (reused, a band's
        memory is not mapped again and faulted in at every row)."""
        free = self.free.get(shape)
        if free:
            return free.pop().zero_()
        return torch.zeros(shape, device=self.device)

    def _placements(self, chunk: Chunk, done: int) -> list[Placement]:
        """Where a chunk's first ``done`` rows go: the own cores' rectangles cut to them, each as its window in the
        rank raster and its rows and columns in the chunk."""
        top, bottom = chunk.top, chunk.top + done
        origin_row, origin_col = int(self.window.row_off), int(self.window.col_off)
        found = []
        for r0, r1, c0, c1 in chunk.own[bisect_left(chunk.tops, top - self.band_rows) :]:
            if r0 >= bottom:
                break
            if r1 <= top:
                continue
            y0, y1 = max(r0, top), min(r1, bottom)
            window = Window(c0 - origin_col, y0 - origin_row, c1 - c0, y1 - y0)
            found.append((window, (slice(y0 - top, y1 - top), slice(c0 - chunk.left, c1 - chunk.left))))
        return found

    def _spill_beyond_bound(self) -> None:
        """Waiting chunks over the bound go to disk, the rightmost (needed last by the next row of tiles) first (a
        full file system: the rank raster's DiskFullError)."""
        for index in reversed(range(len(self.chunks))):
            if self.held <= self.bound:
                return
            chunk = self.chunks[index]
            if chunk.sums is not None and index not in self.active:
                self.spilled.put(index, chunk.sums)
                self.held -= chunk.sums.nbytes
                chunk.sums = None

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Within the block the blender writes (the rank raster, a part, a spilled chunk), or hears of the writer
        thread's failure: a failure aborts it (its spilled chunks and the raster's temporary removed), one of a full
        file system raised as a DiskFullError naming the rank raster (:func:`rasterscale.atomic.writing`)."""
        return writing(self.raster.path, on_failure=self._abort)

    def _abort(self) -> None:
        """Write nothing: the writer stopped, the spilled chunks and the rank raster's temporary removed."""
        self.writer.stop()
        self.spilled.clear()
        self.raster.abort()
        self.closed = True

    @property
    def write_s(self) -> tuple[float, float]:
        """The writer thread's seconds putting finished rows, and the main thread's waiting for it."""
        return self.writer.busy_s, self.writer.blocked_s

    def unsaved_bytes(self) -> int:
        return self.raster.unsaved_bytes()

    def save_part(self, path: str | Path) -> tuple[list[int], int] | None:
        """Write the blocks of the rank raster written since the previous part as a part, atomically at
        ``path``; the own tile ids whose cores are now all in parts, and the part's number of blocks. None when
        no block was written since."""
        with self._writing():
            self.writer.drain()
            blocks = self.raster.save_part(path)
        if not blocks:
            return None
        done = sorted(i for i in self.own_ids - self.saved if self.raster.holds(self._local(self.cores[i])))
        self.saved.update(done)
        return done, blocks

    def close(self) -> list[int]:
        """Move the rank raster into place; the own tile ids written. Raises (and writes nothing) when a tile
        was not added."""
        with self._writing():
            self.writer.drain()
        self.writer.stop()
        self.closed = True
        self.spilled.clear()
        if self.next_index != len(self.tiles):
            self.raster.abort()
            missing = [t.tile_id for t in self.tiles[self.next_index :]]
            raise RuntimeError(f"own cores unfinished: {len(missing)} tiles never added (first {missing[:10]})")
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
