"""The points task's pieces without the workflow: a batch's heatmaps decoded on the device, the tiles' core rule
that keeps a point on a tile border once, the merge's one point per place, the heatmap targets and the loss, the
model file's configuration."""

from __future__ import annotations

import geopandas as gpd
import numpy as np
import pytest
import torch
from affine import Affine
from rasterio.windows import Window

from conftest import write_raster
from rasterscale.grid.manifest import build_manifest, read_grid, tiles_from_frame, write_manifest
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import resolve_spec
from rasterscale.tasks.api import PredictScene
from rasterscale.tasks.blending import tile_cores
from rasterscale.tasks.points.dataset import gaussian_heatmap
from rasterscale.tasks.points.decode import decode_peaks, window_max
from rasterscale.tasks.points.layer import in_cores
from rasterscale.tasks.points.merge import merge_scene, one_per_place
from rasterscale.tasks.points.modelfiles import PeakRule, PointsConfig, peak_window
from rasterscale.tasks.points.rankoutput import PointsRankOutput
from rasterscale.tasks.points.task import focal_loss, heatmap_loss
from segmentation_tiles import split_contiguous


def test_peaks_are_the_highest_of_their_window_above_the_threshold_best_first_in_one_tensor():
    heat = torch.zeros(3, 2, 40, 40)
    heat[0, 0, 5, 7] = 0.9
    heat[0, 0, 5, 9] = 0.8  # within the window of the first: not a peak
    heat[0, 0, 5, 20] = 0.7  # outside it: a peak
    heat[0, 1, 5, 9] = 0.6  # the other class's own peak at the same place
    heat[1, 0, 30, 3] = 0.2  # below the threshold
    points = decode_peaks(heat, peak_window(0.5, 0.1), 0.3, 4)
    assert points.shape == (3, 4, 4) and points.dtype == torch.float32
    first = points[0][points[0, :, 2] > 0].tolist()
    assert first == [[7, 5, pytest.approx(0.9), 0], [20, 5, pytest.approx(0.7), 0], [9, 5, pytest.approx(0.6), 1]]
    assert not (points[1:, :, 2] > 0).any()  # nothing at 0.2, nothing on an empty tile: rows of score 0


def test_the_window_spans_the_distance_either_side():
    assert peak_window(1.0, 0.1) == 21
    assert peak_window(0.05, 0.1) == 3  # never less than one pixel either side


def test_a_point_in_two_overlapping_tiles_is_kept_by_the_one_whose_core_holds_it_batch_or_tile():
    tiles = [Tile(0, 0, 0, 64, 64), Tile(1, 48, 0, 64, 64)]  # 16 px of overlap: cores cut at column 56
    cores = tile_cores(tiles, 112, 64)
    assert cores[0] == Window(0, 0, 56, 64) and cores[1] == Window(56, 0, 56, 64)
    for column in (54.0, 55.0, 56.0, 57.0):  # the same peak seen by both tiles (raster column + 0.5)
        seen = [in_cores(np.array([[[column - tile.col_off, 10.0, 0.9, 0.0]]]), [tile], cores) for tile in tiles]
        kept = [rows for rows in seen if len(rows)]
        assert len(kept) == 1, column
        assert kept[0][0].tolist() == [column + 0.5, 10.5, pytest.approx(0.9), 0.0, float(column + 0.5 >= 56)]
        batch = np.array([[[column - tile.col_off, 10.0, 0.9, 0.0], [5.0, 5.0, 0.0, 0.0]] for tile in tiles])
        assert in_cores(batch, tiles, cores).tolist() == kept[0].tolist()  # both tiles in one pass, the same


def test_one_point_per_place_keeps_the_best_of_each_class_within_the_distance():
    xy = np.array([[0.0, 0.0], [0.5, 0.0], [3.0, 0.0], [0.2, 0.0], [10.0, 10.0], [10.99, 10.0]])
    scores = np.array([0.5, 0.9, 0.8, 0.7, 0.6, 0.4])
    labels = np.array([0, 0, 0, 1, 0, 0])
    keep = one_per_place(xy, scores, labels, 1.0)
    assert keep.tolist() == [False, True, True, True, True, False]
    assert one_per_place(xy[:1], scores[:1], labels[:1], 1.0).tolist() == [True]


def test_the_heatmap_is_one_at_each_points_pixel_and_a_gaussian_around_it():
    heat = gaussian_heatmap(np.array([[10.5, 20.5], [-2.5, 3.5]]), np.array([1, 0]), 2, 32, 32, sigma_px=2.0)
    assert heat.shape == (2, 32, 32) and heat.dtype == np.float32
    assert heat[1, 20, 10] == 1.0 and heat[1].max() == 1.0 and heat[0].max() < 1.0  # the second point is outside
    assert heat[1, 20, 12] == pytest.approx(np.exp(-4 / 8), rel=1e-6)
    assert heat[0, 3, 0] == pytest.approx(np.exp(-9 / 8), rel=1e-6)  # 3 px from a point left of the tile


def test_the_focal_loss_is_lower_for_a_heatmap_nearer_its_targets_and_leaves_out_masked_pixels():
    targets = torch.from_numpy(gaussian_heatmap(np.array([[8.5, 8.5]]), np.array([0]), 1, 16, 16, 1.5))[None]
    good, bad = torch.logit(targets.clamp(0.01, 0.99)), torch.zeros_like(targets)
    assert focal_loss(good, targets) < focal_loss(bad, targets)
    masked = targets.clone()
    masked[..., :4, :] = torch.nan
    noisy = good.clone()
    noisy[..., :4, :] = 50.0  # confident points where nothing is known: no cost
    assert heatmap_loss(noisy, masked, "focal") == pytest.approx(
        float(focal_loss(good[..., 4:, :], targets[..., 4:, :]))
    )
    assert heatmap_loss(good, torch.full_like(targets, torch.nan), "mse") == 0.0


def test_a_point_models_configuration_round_trips_and_refuses_what_it_cannot_train():
    cfg = PointsConfig(labels=("tree", "snag"), sigma=0.4, score_threshold=0.25, points_per_tile=50)
    assert PointsConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="loss"):
        PointsConfig(loss="l1")
    with pytest.raises(ValueError, match="sigma"):
        PointsConfig(sigma=0)


# --- ranks and merge ----------------------------------------------------------------------------------------------

PATCH, OVERLAP, SIGMA_PX = 128, 32, 1.5
TRANSFORM = Affine(0.5, 0, 404000.0, 0, -0.5, 3285000.0)  # 0.5 m pixels


def true_points(cores: dict[int, Window], width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres (column, row) every 12 px, and either side of every core's left and top edge (the pixels a
    tile's core and its neighbour's meet at), of two classes."""
    grid = [(c + 0.5, r + 0.5) for r in range(5, height, 12) for c in range(5, width, 12)]
    edges = {int(core.col_off) for core in cores.values()} - {0}
    tops = {int(core.row_off) for core in cores.values()} - {0}
    grid += [(float(col) + dc, 200.5) for col in edges for dc in (-0.5, 0.5 + 4)]
    grid += [(301.5, float(row) + dr) for row in tops for dr in (-0.5, 0.5 + 4)]
    xy = np.unique(np.array(grid), axis=0)
    return xy, (np.arange(len(xy)) % 2).astype(np.int64)


def rank_files_of(scene, cfg, tiles, xy, labels, folder, ranks: int) -> list:
    """Each rank's point file, its own tiles' heatmaps (a Gaussian per true point) added 5 tiles a batch."""
    cores = tile_cores(tiles, scene.width, scene.height)
    by_id = {tile.tile_id: tile for tile in tiles}
    paths = []
    for rank, own in enumerate(split_contiguous(tiles, ranks)):
        rule = PeakRule(peak_window(1.0, 0.5), cfg.score_threshold, cfg.points_per_tile)
        out = PointsRankOutput(scene, cfg.labels, folder / f"rank-{rank}.parquet", (), rule, cores)
        mine = [by_id[tile_id] for tile_id in own]
        for start in range(0, len(mine), 5):
            batch = mine[start : start + 5]
            heat = [
                gaussian_heatmap(xy - (t.col_off, t.row_off), labels, 2, t.height, t.width, SIGMA_PX) for t in batch
            ]
            out.add_batch(batch, torch.from_numpy(np.stack(heat)))
        out.write()
        paths.append(out.path)
    return paths


def test_points_over_1_2_and_3_ranks_merge_to_each_true_point_once_on_valid_pixels(tmp_path):
    """Heatmaps of known points (a Gaussian each, points on both sides of every core's edge included), decoded per
    batch by 1, 2 and 3 ranks' outputs, merge to the same layer: every true point on a valid pixel exactly once, at
    its pixel's centre in the raster's CRS, with its class; none on the no-data corner."""
    width, height = 400, 300
    data = np.random.default_rng(1).integers(1, 255, size=(3, height, width), dtype=np.uint8)
    data[:, :40, :60] = 0  # no data in a corner
    raster = write_raster(tmp_path / "scene.tif", width, height, transform=TRANSFORM, nodata=0, data=data)
    spec = resolve_spec(raster)
    frame = build_manifest(raster, PATCH, OVERLAP, spec=spec)
    manifest = tmp_path / "tiles.parquet"
    write_manifest(frame, spec, TileGrid(PATCH, OVERLAP), manifest)
    tiles = tiles_from_frame(frame)
    info = check_raster(raster)
    scene = PredictScene("scene", str(raster), tiles, spec, read_grid(manifest), width, height, TRANSFORM, info.crs)
    cfg = PointsConfig(labels=("tree", "shrub"), patch_size=PATCH, score_threshold=0.5)
    xy, labels = true_points(tile_cores(tiles, width, height), width, height)
    valid = ~((xy[:, 0] < 60) & (xy[:, 1] < 40))
    expected = sorted(zip(np.array(cfg.labels)[labels[valid]], xy[valid, 0], xy[valid, 1], strict=True))
    layers = {}
    for ranks in (1, 2, 3):
        folder = tmp_path / f"ranks{ranks}"
        folder.mkdir()
        files = rank_files_of(scene, cfg, tiles, xy, labels, folder, ranks)
        assert sum(len(gpd.read_parquet(path)) for path in files) == len(xy), ranks  # once before the merge too
        merged = merge_scene(files, manifest, raster, folder / "points.gpkg", folder / "points.parquet", 1.0)
        found = sorted(zip(merged["label"], merged["px_x"], merged["px_y"], strict=True))
        assert found == expected, ranks  # each true point once: none lost on a core's edge, none twice
        assert np.allclose(merged.geometry.x, 404000.0 + 0.5 * merged["px_x"]), ranks
        assert np.allclose(merged.geometry.y, 3285000.0 - 0.5 * merged["px_y"]), ranks
        assert merged.crs == info.crs and (merged["score"] == 1.0).all()
        assert gpd.read_file(folder / "points.gpkg", layer="points").shape[0] == len(expected)
        layers[ranks] = merged.drop(columns="tile_id")
    assert layers[1].equals(layers[2]) and layers[1].equals(layers[3])


def test_the_window_maximum_is_a_square_max_pool():
    heat = torch.rand(2, 3, 37, 41)
    for window in (3, 9, 17):
        square = torch.nn.functional.max_pool2d(heat, window, stride=1, padding=window // 2)
        assert torch.equal(window_max(heat, window), square), window
