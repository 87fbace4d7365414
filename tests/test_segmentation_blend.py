"""Blending tile predictions into rank rasters: cores partition the raster, any split over ranks and shards gives the
class map and probabilities of the raster-wide blend, edge weights beat one tile per pixel near tile edges, and what a
rank holds stays within its bound whatever the width."""

from __future__ import annotations

import numpy as np
import pytest
import rasterio
import torch
from affine import Affine

from conftest import UTM17N, report
from rasterscale.grid.manifest import build_manifest, tile_grid, tiles_from_frame
from rasterscale.grid.tile import Tile
from rasterscale.raster.imagery import read_masked, resolve_spec
from rasterscale.tasks.blender import CHUNK_COLS
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.blend import (
    BLEND_MB,
    TileBlender,
    axis_weights,
    edge_weights,
    halo_tiles,
    tile_cores,
)
from rasterscale.tasks.segmentation.merge import merge_class_rasters
from rasterscale.tasks.segmentation.rankoutput import BLOCK_COLS, BLOCK_ROWS
from segmentation_tiles import (
    NUM_CLASSES,
    class_map,
    predict_ranks,
    scene_with_hole,
    split_contiguous,
    tile_probabilities,
)

PATCH, OVERLAP = 256, 64
LABELS = ["background", "disc", "rectangle"]
TRANSFORM = Affine(0.5, 0, 404000.0, 0, -0.5, 3285000.0)


def grid_tiles(width: int, height: int, patch: int = PATCH, overlap: int = OVERLAP) -> list[Tile]:
    return [Tile(k, *map(int, row)) for k, row in enumerate(tile_grid(width, height, patch, overlap))]


def coverage(cores: dict, width: int, height: int) -> np.ndarray:
    count = np.zeros((height, width), dtype=np.int32)
    for core in cores.values():
        count[core.row_off : core.row_off + core.height, core.col_off : core.col_off + core.width] += 1
    return count


def reference_blend(tiles: list[Tile], truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The whole raster's Σ w·p and Σ w at once in NumPy, in manifest order (the blend before it ran on a device,
    which the blender must equal, core by core): its classes and its probabilities as round(p * 255)."""
    height, width = truth.shape
    total = np.zeros((NUM_CLASSES, height, width), dtype=np.float32)
    weights = np.zeros((height, width), dtype=np.float32)
    for tile in tiles:
        rows = slice(tile.row_off, tile.row_off + tile.height)
        cols = slice(tile.col_off, tile.col_off + tile.width)
        tile_weights = edge_weights(tile, width, height, OVERLAP)
        total[:, rows, cols] += tile_probabilities(tile, truth) * tile_weights
        weights[rows, cols] += tile_weights
    with np.errstate(invalid="ignore", divide="ignore"):
        probabilities = np.rint(np.clip(total / weights, 0.0, 1.0) * 255.0)
    return np.argmax(total, axis=0).astype(np.uint8), np.nan_to_num(probabilities).astype(np.uint8)


@pytest.mark.parametrize("size", [(1000, 700), (256, 256), (200, 900)])
def test_cores_partition_the_raster(size):
    width, height = size
    tiles = grid_tiles(width, height)
    cores = tile_cores(tiles, width, height)
    assert np.all(coverage(cores, width, height) == 1)
    for tile in tiles:
        core = cores[tile.tile_id]
        assert tile.col_off <= core.col_off and core.col_off + core.width <= tile.col_off + tile.width
        assert tile.row_off <= core.row_off and core.row_off + core.height <= tile.row_off + tile.height


def test_cores_of_a_manifest_with_tiles_left_out_hold_every_valid_pixel_once(tmp_path):
    width, height = 1000, 700
    scene = scene_with_hole(tmp_path / "scene.tif", width, height, hole_cols=(370, 660))
    spec = resolve_spec(scene)
    tiles = tiles_from_frame(build_manifest(scene, PATCH, OVERLAP, skip_nodata=True, spec=spec))
    full = grid_tiles(width, height)
    assert len(tiles) < len(full) and 384 not in {t.col_off for t in tiles}  # a whole column of tiles left out
    count = coverage(tile_cores(tiles, width, height), width, height)
    with rasterio.open(scene) as src:
        valid = read_masked(src, spec)[1]
    assert count.max() == 1 and np.all(count[valid] == 1)
    report(
        f"cores: {len(tiles)} of {len(full)} tiles kept; {int(valid.sum())} valid pixels each in exactly one core, "
        f"{int((count == 0).sum())} pixels in none (all no data)"
    )


def test_edge_weights_taper_inner_edges_only_and_sum_to_one_across_an_overlap():
    width, height = 1000, 700
    tiles = {(t.row_off, t.col_off): t for t in grid_tiles(width, height)}
    corner = edge_weights(tiles[(0, 0)], width, height, OVERLAP)
    assert corner.shape == (PATCH, PATCH) and corner.dtype == np.float32
    assert corner[0, 0] == 1.0 and corner[0, PATCH // 2] == 1.0  # raster edges are not tapered
    assert corner[PATCH // 2, -1] < 0.001 + 1e-6 and corner.min() >= 1e-3
    left = axis_weights(0, PATCH, width, OVERLAP)
    right = axis_weights(PATCH - OVERLAP, PATCH, width, OVERLAP)
    np.testing.assert_allclose(left[PATCH - OVERLAP :] + right[:OVERLAP], 1.0, atol=1e-12)
    assert np.all(np.diff(right[:OVERLAP]) > 0)


def test_halo_of_an_inner_tile_is_its_eight_neighbours():
    width, height = 1000, 700
    tiles = grid_tiles(width, height)
    cores = tile_cores(tiles, width, height)
    middle = next(t for t in tiles if (t.row_off, t.col_off) == (192, 384))
    halo = halo_tiles(tiles, [middle.tile_id], cores)
    assert {(t.row_off, t.col_off) for t in halo} == {(r, c) for r in (0, 192, 384) for c in (192, 384, 576)}
    assert halo == sorted(halo, key=lambda t: (t.row_off, t.col_off))


def test_any_split_over_ranks_and_shards_gives_the_numpy_blend(tmp_path):
    width, height = 1000, 700
    scene = scene_with_hole(tmp_path / "scene.tif", width, height, hole_cols=(370, 660))
    spec = resolve_spec(scene)
    tiles = tiles_from_frame(build_manifest(scene, PATCH, OVERLAP, skip_nodata=True, spec=spec))
    truth = class_map(width, height)
    with rasterio.open(scene) as src:
        transform = src.transform
        valid = read_masked(src, spec)[1]
    classes, probabilities = reference_blend(tiles, truth)
    # (ranks, shards, blend_mb, probabilities): 0 MB sends every waiting chunk to disk at once; without the
    # probabilities the band sums no weights (the classes are the argmax of the weighted sums alone)
    cases = ((1, 1, BLEND_MB, True), (2, 1, BLEND_MB, True), (3, 1, BLEND_MB, True), (2, 2, BLEND_MB, True))
    for ranks, shards, blend_mb, with_probabilities in (*cases, (2, 1, 0, True), (3, 1, BLEND_MB, False)):
        out = tmp_path / f"ranks-{ranks}-shards-{shards}-mb-{blend_mb}-{with_probabilities}"
        out.mkdir()
        rank_rasters = predict_ranks(
            tiles, truth, OVERLAP, out, ranks, transform, UTM17N, with_probabilities, blend_mb=blend_mb, shards=shards
        )
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in rank_rasters)  # no spill folder left
        probabilities_path = out / "probabilities.tif" if with_probabilities else None
        merge_class_rasters(rank_rasters, scene, spec, out / "classes.tif", probabilities_path, LABELS)
        with rasterio.open(out / "classes.tif") as merged:
            blended = merged.read(1)
        assert np.all((blended == NODATA_CLASS) == ~valid)
        assert np.array_equal(blended[valid], classes[valid]), (ranks, shards, blend_mb, with_probabilities)
        if with_probabilities:
            with rasterio.open(out / "probabilities.tif") as probs:
                assert np.array_equal(probs.read()[:, valid], probabilities[:, valid]), (ranks, shards, blend_mb)
    accuracy = float((blended[valid] == truth[valid]).mean())
    report(
        "blend: 1, 2 and 3 ranks, 2 shards of 2 ranks, and 2 ranks sending every waiting chunk to disk give the class "
        "map and probabilities of the raster-wide NumPy blend, 3 ranks without probabilities its class map; pixel "
        f"accuracy {accuracy:.4f}"
    )


def one_tile_per_pixel(tiles: list[Tile], truth: np.ndarray) -> np.ndarray:
    """Each pixel's class from the one tile whose core holds it (no blending)."""
    height, width = truth.shape
    cores = tile_cores(tiles, width, height)
    classes = np.full((height, width), NODATA_CLASS, dtype=np.uint8)
    for tile in tiles:
        core = cores[tile.tile_id]
        r0, c0 = core.row_off - tile.row_off, core.col_off - tile.col_off
        probs = tile_probabilities(tile, truth)[:, r0 : r0 + core.height, c0 : c0 + core.width]
        classes[core.row_off : core.row_off + core.height, core.col_off : core.col_off + core.width] = np.argmax(
            probs, axis=0
        )
    return classes


def near_lines(positions: set[int], length: int, distance: int) -> np.ndarray:
    near = np.zeros(length, dtype=bool)
    for position in positions:
        near[max(0, position - distance) : position + distance] = True
    return near


def test_edge_weights_beat_one_tile_per_pixel_near_inner_tile_edges(tmp_path):
    width, height = 1400, 1000
    tiles = grid_tiles(width, height)
    truth = class_map(width, height, seed=3)
    (rank_raster,) = predict_ranks(tiles, truth, OVERLAP, tmp_path, 1, TRANSFORM, UTM17N)
    with rasterio.open(rank_raster) as src:
        blended = src.read(1)
    single = one_tile_per_pixel(tiles, truth)
    cores = tile_cores(tiles, width, height)
    edge_cols = {t.col_off for t in tiles if t.col_off > 0} | {
        t.col_off + t.width for t in tiles if t.col_off + t.width < width
    }
    edge_rows = {t.row_off for t in tiles if t.row_off > 0} | {
        t.row_off + t.height for t in tiles if t.row_off + t.height < height
    }
    seam_cols = {c.col_off for c in cores.values() if c.col_off > 0}
    seam_rows = {c.row_off for c in cores.values() if c.row_off > 0}
    regions = {
        "within 16 px of inner tile edges": near_lines(edge_rows, height, 16)[:, None]
        | near_lines(edge_cols, width, 16)[None, :],
        "within 16 px of core seams": near_lines(seam_rows, height, 16)[:, None]
        | near_lines(seam_cols, width, 16)[None, :],
    }
    for name, region in regions.items():
        blend_accuracy = float((blended[region] == truth[region]).mean())
        single_accuracy = float((single[region] == truth[region]).mean())
        report(
            f"blend accuracy {name}: edge weights {blend_accuracy:.4f}, one tile per pixel {single_accuracy:.4f} "
            f"({int(region.sum())} pixels)"
        )
        assert blend_accuracy > single_accuracy + 0.005


def test_tiles_out_of_order_or_missing_fail_and_write_nothing(tmp_path):
    width, height = 700, 500
    tiles = grid_tiles(width, height)
    truth = class_map(width, height)
    cores = tile_cores(tiles, width, height)
    own = split_contiguous(tiles, 2)[0]
    todo = halo_tiles(tiles, own, cores)
    path = tmp_path / "rank-0.tif"
    blender = TileBlender(todo, set(own), cores, width, height, NUM_CLASSES, OVERLAP, path, TRANSFORM, UTM17N)
    with pytest.raises(ValueError, match=f"tile {todo[1].tile_id} added out of order"):
        blender.add(todo[1].tile_id, tile_probabilities(todo[1], truth))
    for tile in todo[:-1]:
        blender.add(tile.tile_id, tile_probabilities(tile, truth))
    with pytest.raises(RuntimeError, match="own cores unfinished"):
        blender.close()
    assert not path.exists() and not list(tmp_path.iterdir())


def test_a_blender_lets_its_bands_and_weights_go_at_its_last_tile_and_still_writes_the_blend(tmp_path):
    """A job holds each of its scenes' rank outputs open until it writes them all: a scene's blender keeps no band
    for reuse and no edge weights once its last tile is in (on a GPU they are device memory beyond blend_mb)."""
    width, height = 700, 500
    tiles = grid_tiles(width, height)
    truth = class_map(width, height)
    cores = tile_cores(tiles, width, height)
    path = tmp_path / "rank-0.tif"
    blender = TileBlender(
        tiles, {t.tile_id for t in tiles}, cores, width, height, NUM_CLASSES, OVERLAP, path, TRANSFORM, UTM17N
    )
    for tile in tiles[:-1]:
        blender.add(tile.tile_id, tile_probabilities(tile, truth))
    blender.writer.drain()
    kept = sum(len(bands) for bands in blender.free.values()), len(blender.weights.made)
    assert kept[0] > 0 and kept[1] > 0
    blender.add(tiles[-1].tile_id, tile_probabilities(tiles[-1], truth))
    blender.writer.drain()
    assert not blender.free and not blender.weights.made and not blender.weights.batches
    assert blender.close() == sorted(t.tile_id for t in tiles)
    with rasterio.open(path) as raster:
        classes = raster.read(1)
    expected, _ = reference_blend(tiles, truth)
    np.testing.assert_array_equal(classes, expected)
    report(f"blender at its last tile: {kept[0]} band(s) and {kept[1]} kind(s) of weights let go; classes equal")


def blend_random_strip(path, width: int, height: int, patch: int, overlap: int, classes: int, blend_mb: float):
    """Blend a strip of random probabilities, a row of tiles per batch; the blender (closed)."""
    tiles = grid_tiles(width, height, patch, overlap)
    cores = tile_cores(tiles, width, height)
    rng = np.random.default_rng(0)
    probs = rng.random((classes, patch, patch), dtype=np.float32)
    probs /= probs.sum(axis=0, keepdims=True)
    own = {t.tile_id for t in tiles}
    blender = TileBlender(
        tiles, own, cores, width, height, classes, overlap, path, TRANSFORM, UTM17N, True, blend_mb=blend_mb
    )
    per_row = width // (patch - overlap)
    for start in range(0, len(tiles), per_row):
        batch = tiles[start : start + per_row]
        blender.add_batch([t.tile_id for t in batch], torch.from_numpy(probs).expand(len(batch), -1, -1, -1))
    blender.close()
    return blender


def test_blend_memory_of_a_strip_stays_within_its_bound_whatever_its_width(tmp_path):
    """What the band holds past its bound waits on disk: at 8k and 16k wide, what it holds peaks at the bound plus
    the chunks one tile reaches (a tile's height of rows); unbounded, it holds an overlap's rows across the width."""
    height, patch, overlap, classes, bound_mb = 1600, 400, 100, 2, 4.0
    peaks, unbounded = {}, {}
    for width in (8192, 16384):
        blender = blend_random_strip(tmp_path / f"rank-{width}.tif", width, height, patch, overlap, classes, bound_mb)
        peaks[width] = blender.peak_pending_bytes / 2**20
        assert blender.spilled.written_bytes > 0 and not blender.spilled.folder.exists()
        with rasterio.open(tmp_path / f"rank-{width}.tif") as src:
            assert (src.width, src.height, src.count) == (width, height, 1 + classes)
            assert src.block_shapes[0] == (BLOCK_ROWS, BLOCK_COLS)
        path = tmp_path / f"unbounded-{width}.tif"
        unbounded[width] = blend_random_strip(path, width, height, patch, overlap, classes, 1e6).peak_pending_bytes
    # a tile reaches at most two chunks (CHUNK_COLS px or more each; the last one up to twice that)
    reach_mb = (1 + classes) * 4 * patch * 2 * 2 * CHUNK_COLS / 2**20
    overlap_growth = (1 + classes) * 4 * overlap * 8192 / 2**20  # an overlap's rows across 8192 more columns
    report(
        f"blend memory of a strip {height} px high ({patch} px tiles, overlap {overlap}), bound {bound_mb} MB: peak "
        f"{peaks[8192]:.1f} MiB at 8192 px wide, {peaks[16384]:.1f} MiB at 16384; unbounded "
        f"{unbounded[8192] / 2**20:.1f} and {unbounded[16384] / 2**20:.1f} MiB"
    )
    assert max(peaks.values()) <= bound_mb + reach_mb
    assert abs(peaks[16384] - peaks[8192]) <= reach_mb / 2
    assert (unbounded[16384] - unbounded[8192]) / 2**20 >= overlap_growth * 0.9


def test_a_rank_without_tiles_writes_one_pixel_of_no_data(tmp_path):
    width, height = 700, 500
    tiles = grid_tiles(width, height)
    cores = tile_cores(tiles, width, height)
    assert halo_tiles(tiles, [], cores) == []
    path = tmp_path / "rank-3.tif"
    blender = TileBlender([], set(), cores, width, height, NUM_CLASSES, OVERLAP, path, TRANSFORM, UTM17N)
    assert blender.close() == []
    with rasterio.open(path) as src:
        assert (src.width, src.height, src.transform) == (1, 1, TRANSFORM) and src.read(1)[0, 0] == NODATA_CLASS
