"""Instances: masks to crown polygons, rank files (parts and resume), the merge across tile overlaps by mask IoU,
the evaluation by mask IoU and its quicklook. Real masks, real GeoParquet files, no mocks.

The scene: a 700 x 400 raster cut into two 400 px tiles overlapping by 100 px (tile 0: cols 0-400, tile 1: cols
300-700); its only inner tile edges are x = 300 (tile 1's left side) and x = 400 (tile 0's right side).
"""

from __future__ import annotations

import json

import geopandas as gpd
import numpy as np
import pytest
import shapely
from affine import Affine

from conftest import UTM17N, report, write_raster
from rasterscale.grid.manifest import manifest_frame, tile_grid, tiles_from_frame, write_manifest
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.geo import box_pairs, pair_ious
from rasterscale.raster.imagery import resolve_spec
from rasterscale.settings import job_settings, settings_of
from rasterscale.tasks.api import PredictScene
from rasterscale.tasks.detectors.merge import count_labels as count_instances
from rasterscale.tasks.detectors.merge import greedy_nms, read_rank_files
from rasterscale.tasks.instances.merge import merge_scene, metric_measures
from rasterscale.tasks.instances.metrics import crosses_inner_edges, evaluate_instances, evaluate_scene
from rasterscale.tasks.instances.polygons import empty_instances, instances_frame, tile_instances
from rasterscale.tasks.instances.quicklook import render_instances_quicklook, scored_crowns
from rasterscale.tasks.instances.rankoutput import InstanceRankOutput

TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
WIDTH, HEIGHT, PATCH, OVERLAP = 700, 400, 400, 100
MERGE = job_settings({"merge": {"iou_threshold": 0.4, "edge_tolerance": 2, "containment_threshold": 0.6}}).merge
LABELS = ["tree", "snag"]
YY, XX = np.mgrid[0:HEIGHT, 0:WIDTH]  # scene pixel centres are at (XX + 0.5, YY + 0.5)


def disk(cx: float, cy: float, r: float) -> np.ndarray:
    """A scene-sized mask of the pixels whose centre is within ``r`` of (cx, cy)."""
    return (XX + 0.5 - cx) ** 2 + (YY + 0.5 - cy) ** 2 <= r**2


def rect(x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), dtype=bool)
    mask[y0:y1, x0:x1] = True
    return mask


def ells(x0: int, y0: int, side: int, arm: int) -> tuple[np.ndarray, np.ndarray]:
    """Two L-shapes in one square: one along its top and left sides, the other along its bottom and right
    sides. Their boxes are the same square (box IoU 1); their masks share two arm x arm corners only."""
    first = rect(x0, y0, x0 + side, y0 + arm) | rect(x0, y0, x0 + arm, y0 + side)
    second = rect(x0, y0 + side - arm, x0 + side, y0 + side) | rect(x0 + side - arm, y0, x0 + side, y0 + side)
    return first, second


def in_tile(masks: list[np.ndarray], tile: Tile) -> np.ndarray:
    """Scene-sized masks as a tile's model output: (N, H, W) uint8 at the tile's pixels."""
    window = np.s_[tile.row_off : tile.row_off + tile.height, tile.col_off : tile.col_off + tile.width]
    return np.stack([m[window] for m in masks]).astype(np.uint8) if masks else np.zeros((0, tile.height, tile.width))


def result(masks: list[np.ndarray], tile: Tile, scores: list[float], labels: list[int] | None = None) -> dict:
    """A tile's result as the model's rank output takes it (boxes unused: an instance's box is its polygon's)."""
    n = len(masks)
    return {
        "boxes": np.zeros((n, 4), dtype=np.float32),
        "scores": np.asarray(scores, dtype=np.float32),
        "labels": np.asarray(labels if labels is not None else [0] * n, dtype=np.int64),
        "masks": in_tile(masks, tile),
    }


def make_scene(tmp_path, **raster) -> dict:
    """The raster (``write_raster``'s keywords), its manifest, its tiles and the PredictScene a rank sees."""
    raster = write_raster(tmp_path / "scene.tif", WIDTH, HEIGHT, **raster)
    spec = resolve_spec(raster)
    frame = manifest_frame(tile_grid(WIDTH, HEIGHT, PATCH, OVERLAP), TRANSFORM, UTM17N)
    write_manifest(frame, spec, TileGrid(PATCH, OVERLAP), tmp_path / "tiles.parquet")
    tiles = tiles_from_frame(frame)
    assert [(t.col_off, t.width) for t in tiles] == [(0, 400), (300, 400)]
    predict = PredictScene(
        "scene", str(raster), tiles, spec, TileGrid(PATCH, OVERLAP), WIDTH, HEIGHT, TRANSFORM, UTM17N
    )
    return {"raster": raster, "manifest": tmp_path / "tiles.parquet", "tiles": tiles, "predict": predict}


@pytest.fixture
def scene(tmp_path):
    return make_scene(tmp_path)


def predict_and_merge(tmp_path, scene, per_tile: list[dict]) -> gpd.GeoDataFrame:
    """Each tile's result to its own rank's file (tile k: rank k), then the scene's merge."""
    rank_files = []
    for k, (tile, found) in enumerate(zip(scene["tiles"], per_tile, strict=True)):
        output = InstanceRankOutput(scene["predict"], LABELS, tmp_path / f"rank-{k}.parquet")
        output.add(tile, found)
        output.write()
        rank_files.append(tmp_path / f"rank-{k}.parquet")
    return merge_scene(
        rank_files, scene["manifest"], scene["raster"], tmp_path / "crowns.gpkg", tmp_path / "crowns.parquet", MERGE
    )


# -- masks to polygons ------------------------------------------------------------------------------------------


def test_a_mask_becomes_one_polygon_of_its_pixels_placed_in_the_scene_and_the_crs():
    tile = Tile(1, 300, 0, 400, 400)
    crown = disk(480.3, 150.8, 31)
    ring = disk(600, 300, 30) & ~disk(600, 300, 12)  # a crown with a hole
    blobs = disk(350, 350, 20) | disk(420, 350, 8)  # two parts: the largest is the crown
    empty = np.zeros_like(crown)
    masks = in_tile([crown, ring, blobs, empty], tile)
    found = tile_instances(masks, [0.9, 0.8, 0.7, 0.6], [0, 1, 0, 0], tile, WIDTH, HEIGHT)
    assert found.scores.tolist() == pytest.approx([0.9, 0.8, 0.7]) and found.labels.tolist() == [0, 1, 0]
    polygons = found.polygons
    assert all(p.geom_type == "Polygon" and p.is_valid for p in polygons)
    for polygon, mask in zip(polygons, [crown, ring, disk(350, 350, 20)], strict=True):
        # traced along pixel edges, simplified within half a pixel: the area moves by at most half a pixel a
        # unit of outline
        assert abs(polygon.area - mask.sum()) <= 0.5 * polygon.length
        ys, xs = np.nonzero(mask)  # scene pixel coordinates: the tile's offset added
        assert polygon.centroid.x == pytest.approx(xs.mean() + 0.5, abs=0.3)
        assert polygon.centroid.y == pytest.approx(ys.mean() + 0.5, abs=0.3)
    assert len(polygons[1].interiors) == 1  # the hole is kept
    probabilities = in_tile([crown, ring, blobs, empty], tile)[:, None] * np.float32(0.7)  # a model's (N, 1, H, W)
    same = tile_instances(probabilities, [0.9, 0.8, 0.7, 0.6], [0, 1, 0, 0], tile, WIDTH, HEIGHT)
    assert all(a.equals(b) for a, b in zip(same.polygons, polygons, strict=True))
    assert shapely.get_num_coordinates(polygons[0]) < 60  # a 31 px disk traced along its pixels has 200 vertices

    frame = instances_frame([found], LABELS, TRANSFORM, UTM17N)
    assert frame["label"].tolist() == ["tree", "snag", "tree"] and frame.crs.to_epsg() == 32617
    centre = frame.geometry.iloc[0].centroid  # the CRS polygon: the affine transform of the pixel one
    assert (centre.x, centre.y) == pytest.approx(TRANSFORM @ (polygons[0].centroid.x, polygons[0].centroid.y))
    assert frame.geometry.iloc[0].area == pytest.approx(polygons[0].area * 0.01)
    assert frame[["px_xmin", "px_ymin", "px_xmax", "px_ymax"]].iloc[0].tolist() == list(polygons[0].bounds)


def crops_of(masks: np.ndarray, pad: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Tile-sized masks (N, H, W) as the batched Mask R-CNN hands them over: each one's crop of the tile (its
    extent and ``pad`` px more, cut to the tile), at the largest crop's size (zero beyond a mask's own), and each
    crop's origin (column, row)."""
    extents = []
    for mask in masks:
        rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
        r0, c0 = max(0, rows[0] - pad), max(0, cols[0] - pad)
        extents.append((r0, min(mask.shape[0], rows[-1] + 1 + pad), c0, min(mask.shape[1], cols[-1] + 1 + pad)))
    height, width = max(r1 - r0 for r0, r1, _, _ in extents), max(c1 - c0 for _, _, c0, c1 in extents)
    crops = np.zeros((len(masks), height, width), dtype=masks.dtype)
    for crop, mask, (r0, r1, c0, c1) in zip(crops, masks, extents, strict=True):
        crop[: r1 - r0, : c1 - c0] = mask[r0:r1, c0:c1]
    return crops, np.array([(c0, r0) for r0, _, c0, _ in extents], dtype=np.int64)


def test_an_instance_is_cut_where_its_mask_reaches_an_inner_tile_edge_not_the_rasters():
    """Whether the masks are whole tiles or crops of them with their origins (as the batched Mask R-CNN gives
    them), the same instances are cut and traced alike."""
    left, right = Tile(0, 0, 0, 400, 400), Tile(1, 300, 0, 400, 400)
    at_inner = disk(390, 200, 20)  # reaches x = 400, tile 0's right side, an inner edge
    at_raster = disk(20, 200, 25)  # reaches x = 0, the raster's left edge
    at_top = disk(150, 5, 12)  # reaches y = 0: the raster's top edge
    at_bottom = disk(200, 392, 10)  # reaches y = 400, the raster's bottom edge
    inside = disk(200, 200, 30)
    at_left = disk(310, 100, 20)  # reaches x = 300, tile 1's left side, an inner edge
    at_right = disk(690, 100, 20)  # reaches x = 700, the raster's right edge
    for tile, disks, cut in [
        (left, [at_inner, at_raster, at_top, at_bottom, inside], [True, False, False, False, False]),
        (right, [at_left, at_right], [True, False]),
    ]:
        masks, scores, labels = in_tile(disks, tile), [0.9] * len(disks), [0] * len(disks)
        whole = tile_instances(masks, scores, labels, tile, 700, 400)
        assert whole.cut.tolist() == cut
        crops, origins = crops_of(masks)
        assert crops.shape[1] < 400 and crops.shape[2] < 400
        cropped = tile_instances(crops, scores, labels, tile, 700, 400, origins=origins)
        assert cropped.cut.tolist() == cut
        assert all(a.equals_exact(b, 0.0) for a, b in zip(cropped.polygons, whole.polygons, strict=True))
    # a tile inside a larger raster: every edge is inner
    tile = Tile(2, 100, 50, 300, 300)
    masks = in_tile([disk(200, 55, 10), disk(200, 345, 10), disk(105, 200, 10), disk(250, 200, 30)], tile)
    crops, origins = crops_of(masks)
    cut = tile_instances(crops, [0.9] * 4, [0] * 4, tile, 900, 900, origins=origins).cut
    assert cut.tolist() == [True, True, True, False]


# -- the merge --------------------------------------------------------------------------------------------------


def test_a_crown_cut_by_one_tile_and_whole_in_the_other_merges_to_the_whole_one(tmp_path, scene):
    crown = disk(385, 200, 40)  # cols 345-425: tile 0 (cols 0-400) sees it cut at x = 400, tile 1 whole
    left, right = scene["tiles"]
    merged = predict_and_merge(tmp_path, scene, [result([crown], left, [0.95]), result([crown], right, [0.6])])
    assert len(merged) == 1  # the cut one scored higher: it still gives way to the whole one
    assert merged["score"].iloc[0] == pytest.approx(0.6)
    assert merged["area_m2"].iloc[0] == pytest.approx(crown.sum() * 0.01, rel=0.05)  # 0.1 m pixels
    assert merged["perimeter_m"].iloc[0] == pytest.approx(2 * np.pi * 40 * 0.1, rel=0.05)
    on_disk = gpd.read_file(tmp_path / "crowns.gpkg", layer="crowns")
    assert on_disk.crs.to_epsg() == 32617 and list(on_disk.columns) == [
        "label",
        "score",
        "area_m2",
        "perimeter_m",
        "geometry",
    ]
    assert gpd.read_parquet(tmp_path / "crowns.parquet").geometry.iloc[0].equals(merged.geometry.iloc[0])
    ranks = read_rank_files([tmp_path / "rank-0.parquet", tmp_path / "rank-1.parquet"], empty_instances)
    assert ranks["cut"].tolist() == [True, False]


def test_duplicates_merge_by_mask_iou_while_interleaved_crowns_whose_boxes_coincide_both_stay(tmp_path, scene):
    left, right = scene["tiles"]
    first, second = ells(320, 100, 60, 15)  # in the overlap (cols 300-400): both tiles see both, whole
    crown = disk(350, 300, 25)
    shifted = disk(351, 301, 25)  # the same crown, seen by the other tile a pixel aside
    per_tile = [
        result([first, second, crown], left, [0.9, 0.8, 0.7]),
        result([first, second, shifted], right, [0.85, 0.75, 0.65]),
    ]
    merged = predict_and_merge(tmp_path, scene, per_tile)
    assert sorted(merged["score"].tolist()) == pytest.approx([0.7, 0.8, 0.9])  # one of each crown, the best scores
    assert count_instances(tmp_path / "crowns.parquet", LABELS) == {"tree": 3, "snag": 0}

    # what box IoU would do: the two L-shapes have the same box, so greedy NMS on boxes drops the lower one
    ranks = read_rank_files([tmp_path / "rank-0.parquet"], empty_instances)
    boxes = ranks[["px_xmin", "px_ymin", "px_xmax", "px_ymax"]].to_numpy()
    i, j = box_pairs(boxes)
    suppressing = pair_ious(boxes[i], boxes[j]) > MERGE.iou_threshold
    assert pair_ious(boxes[:1], boxes[1:2])[0] > 0.95  # the same square, a corner cut aside
    assert greedy_nms(ranks["score"].to_numpy(), i[suppressing], j[suppressing]).sum() == 2  # one L-shape lost


def test_crowns_of_another_label_or_apart_are_never_merged(tmp_path, scene):
    left, right = scene["tiles"]
    crown = disk(150, 200, 30)
    neighbour = disk(208, 200, 28)  # touching the first: distinct crowns
    merged = predict_and_merge(
        tmp_path,
        scene,
        [result([crown, crown, neighbour], left, [0.9, 0.8, 0.7], [0, 1, 0]), result([], right, [])],
    )
    assert sorted(merged["label"].tolist()) == ["snag", "tree", "tree"]


def test_crowns_on_nodata_pixels_are_dropped(tmp_path):
    data = np.random.default_rng(0).integers(1, 255, size=(3, HEIGHT, WIDTH), dtype=np.uint8)
    data[:, :, :100] = 0  # the first 100 columns hold no data
    scene = make_scene(tmp_path, data=data, nodata=0)
    left, right = scene["tiles"]
    on_nodata, on_data = disk(50, 200, 20), disk(200, 200, 20)
    merged = predict_and_merge(tmp_path, scene, [result([on_nodata, on_data], left, [0.9, 0.8]), result([], right, [])])
    assert merged["score"].tolist() == pytest.approx([0.8])


def test_areas_in_metres_whatever_the_crs_unit():
    square = shapely.box(0, 0, 10, 10)
    area, perimeter = metric_measures(np.array([square]), "EPSG:2236")  # Florida East, US survey feet
    assert area[0] == pytest.approx(100 * 0.3048006**2, rel=1e-5) and perimeter[0] == pytest.approx(40 * 0.3048006)
    degrees = shapely.box(-80.0, 26.0, -79.9999, 26.0001)  # about 10 m x 11 m at 26 N, measured in UTM
    area, perimeter = metric_measures(np.array([degrees]), "EPSG:4326")
    assert area[0] == pytest.approx(10.0 * 11.07, rel=0.02)


# -- rank outputs: parts and resume -----------------------------------------------------------------------------


def test_a_rank_output_from_parts_and_new_tiles_writes_what_one_written_at_once_does(tmp_path, scene):
    left, right = scene["tiles"]
    extra = [Tile(2, 0, 0, 400, 400), Tile(3, 300, 0, 400, 400)]  # more tiles of the same windows
    tiles = [left, right, *extra]
    results = [
        result([disk(100, 100, 20), disk(395, 50, 15)], left, [0.9, 0.5]),
        result([], right, []),
        result([disk(200, 300, 30)], extra[0], [0.7]),
        result([disk(600, 100, 10)], extra[1], [0.4], [1]),
    ]
    direct = InstanceRankOutput(scene["predict"], LABELS, tmp_path / "direct.parquet")
    for tile, found in zip(tiles, results, strict=True):
        direct.add(tile, found)
    assert direct.unsaved_bytes() > 0
    direct.write()

    first_run = InstanceRankOutput(scene["predict"], LABELS, tmp_path / "never-written.parquet")
    parts = []
    for k, (tile, found) in enumerate(zip(tiles[:3], results[:3], strict=True)):
        first_run.add(tile, found)
        if k in (1, 2):
            parts.append(first_run.save_part(tmp_path / f"part-{k}.parquet"))
            assert first_run.unsaved_bytes() == 0
    assert first_run.save_part(tmp_path / "nothing.parquet") is None
    assert [p.tiles for p in parts] == [[0, 1], [2]]
    resumed = InstanceRankOutput(scene["predict"], LABELS, tmp_path / "resumed.parquet", parts)  # a rerun
    resumed.add(tiles[3], results[3])
    assert resumed.write() == "4 instances (2 part(s))"

    a, b = gpd.read_parquet(tmp_path / "direct.parquet"), gpd.read_parquet(tmp_path / "resumed.parquet")
    assert a.drop(columns="geometry").equals(b.drop(columns="geometry"))
    assert all(a.geometry.geom_equals_exact(b.geometry, tolerance=0)) and a.crs == b.crs
    assert a["tile_id"].tolist() == [0, 0, 2, 3] and a["cut"].tolist() == [False, True, False, False]


# -- evaluation -------------------------------------------------------------------------------------------------


def square(x0: float, y0: float, side: float = 10, height: float | None = None) -> shapely.Polygon:
    return shapely.box(x0, y0, x0 + side, y0 + (height if height is not None else side))


def l_shape(x0: float, y0: float, flipped: bool) -> shapely.Polygon:
    """An L along the top and left sides of a 30 px square at (x0, y0), or (``flipped``) along its bottom and
    right sides: the two share the square as a box."""
    first = shapely.union(square(x0, y0, 30, 10), square(x0, y0, 10, 30))
    second = shapely.union(square(x0, y0 + 20, 30, 10), square(x0 + 20, y0, 10, 30))
    return second if flipped else first


def test_evaluation_matches_by_mask_iou_with_scores_computed_by_hand():
    truth = np.array([square(0, 0), square(20, 0), l_shape(40, 0, flipped=False)])
    predicted = np.array(
        [
            square(0, 0),  # IoU 1 with truth 0
            square(20, 0, 10, 7),  # IoU 0.7 with truth 1
            l_shape(40, 0, flipped=True),  # its box is truth 2's, its mask is not: IoU 200 / 800 = 0.25
            square(100, 100),  # nothing there
        ]
    )
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    m = evaluate_instances(predicted, scores, np.zeros(4), truth, np.zeros(3), iou_threshold=0.5)
    assert (m["true_positives"], m["predictions"], m["ground_truth"]) == (2, 4, 3)
    assert m["precision"] == pytest.approx(2 / 4) and m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    # ranked TP, TP, FP, FP of 3 truths: precision 1 up to recall 2/3, nothing beyond; 67 of COCO's 101 recall
    # points (0, 0.01, ... 0.66) are at most 2/3
    assert m["map50"] == pytest.approx(67 / 101)
    high = evaluate_instances(predicted, scores, np.zeros(4), truth, np.zeros(3), score_threshold=0.65)
    assert (high["precision"], high["recall"], high["f1"]) == pytest.approx((2 / 3, 2 / 3, 2 / 3))
    assert high["map50"] == pytest.approx(67 / 101)  # AP: all predictions
    other_class = evaluate_instances(predicted[:1], scores[:1], np.ones(1), truth[:1], np.zeros(1))
    assert other_class["true_positives"] == 0


def test_scene_evaluation_writes_json_and_quicklook_and_splits_crowns_at_tile_edges(tmp_path, scene):
    left, right = scene["tiles"]
    at_edge, inside = disk(400, 200, 30), disk(150, 100, 25)
    merged = predict_and_merge(
        tmp_path, scene, [result([inside], left, [0.9]), result([at_edge, disk(600, 330, 20)], right, [0.8, 0.7])]
    )
    assert len(merged) == 3
    truth = np.array([shapely.Point(400, 200).buffer(30), shapely.Point(150, 100).buffer(25)])
    truth = np.append(truth, shapely.Point(550, 100).buffer(25))  # missed: an interior false negative
    windows = np.array([[t.col_off, t.row_off, t.width, t.height] for t in scene["tiles"]])
    assert crosses_inner_edges(truth, windows, WIDTH, HEIGHT).tolist() == [True, False, False]
    metrics = evaluate_scene(
        tmp_path / "crowns.parquet",
        scene["raster"],
        truth,
        np.zeros(3, dtype=np.int64),
        LABELS,
        {"iou_threshold": 0.5, "score_threshold": 0.3},
        tmp_path / "evaluation.json",
        tmp_path / "quicklook.png",
        manifest_path=scene["manifest"],
    )
    assert (metrics["true_positives"], metrics["predictions"], metrics["ground_truth"]) == (2, 3, 3)
    edge, interior = metrics["edge"], metrics["interior"]
    print(f"F1 at tile edges {edge['f1']:.3f}, interior {interior['f1']:.3f}")
    assert (edge["precision"], edge["recall"], edge["f1"]) == (1.0, 1.0, 1.0)
    # interior: 1 of 2 predictions right (the crown at 600, 330 is not in the truth), 1 of 2 truths found
    assert (interior["precision"], interior["recall"], interior["f1"]) == (0.5, 0.5, 0.5)
    assert json.loads((tmp_path / "evaluation.json").read_text())["edge"]["f1"] == 1.0
    png = (tmp_path / "quicklook.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    # a scene without ground truth: the crowns scoring enough, outlined alone
    kept = scored_crowns(tmp_path / "crowns.parquet", TRANSFORM, 0.75)
    assert len(kept) == 2 and kept[0].centroid.distance(shapely.Point(150, 100)) < 1  # in pixels
    render_instances_quicklook(scene["raster"], kept, None, tmp_path / "alone.png", title="2 crowns")
    assert (tmp_path / "alone.png").read_bytes().startswith(b"\x89PNG")


def test_a_perfect_models_crowns_stitch_at_inner_tile_edges_as_well_as_away_from_them(tmp_path):
    """Hundreds of crowns (discs) over a 1100 px scene of 16 overlapping tiles, each tile's masks what a perfect
    model sees there (a crown cut where the tile ends, a score of its own in each tile), the tiles split over 3
    ranks, merged and scored as the workflow does: every crown comes out once, and F1 on the crowns that cross an
    inner tile edge equals F1 away from them. A crown lost or doubled at an edge shows in the first figure."""
    from discs import place_discs
    from rasterscale.config.schema import validate_config

    side, patch, overlap = 1100, 400, 100
    discs = place_discs(np.random.default_rng(3), side, (14, 28), 0.3)
    raster = write_raster(tmp_path / "crowns.tif", side, side)
    frame = manifest_frame(tile_grid(side, side, patch, overlap), TRANSFORM, UTM17N)
    write_manifest(frame, resolve_spec(raster), TileGrid(patch, overlap), tmp_path / "tiles.parquet")
    tiles = tiles_from_frame(frame)
    predict = PredictScene(
        "crowns", str(raster), tiles, resolve_spec(raster), TileGrid(patch, overlap), side, side, TRANSFORM, UTM17N
    )
    score_rng = np.random.default_rng(4)
    outputs = [InstanceRankOutput(predict, LABELS, tmp_path / f"rank-{k}.parquet") for k in range(3)]
    for tile in tiles:
        yy, xx = np.mgrid[tile.row_off : tile.row_off + tile.height, tile.col_off : tile.col_off + tile.width] + 0.5
        x, y, r = discs.T
        near = (x + r > tile.col_off) & (x - r < tile.col_off + tile.width)
        near &= (y + r > tile.row_off) & (y - r < tile.row_off + tile.height)
        masks = [(xx - cx) ** 2 + (yy - cy) ** 2 <= cr * cr for cx, cy, cr in discs[near]]
        seen = [mask for mask in masks if mask.any()]
        found = {
            "boxes": np.zeros((len(seen), 4), dtype=np.float32),
            "scores": score_rng.uniform(0.5, 1.0, len(seen)).astype(np.float32),
            "labels": np.zeros(len(seen), dtype=np.int64),
            "masks": np.stack(seen).astype(np.uint8),
        }
        outputs[tile.tile_id % 3].add(tile, found)
    for output in outputs:
        output.write()
    merged = merge_scene(
        [output.path for output in outputs],
        tmp_path / "tiles.parquet",
        raster,
        tmp_path / "crowns.gpkg",
        tmp_path / "crowns.parquet",
        settings_of(validate_config({"task": "instances"})).merge,
    )
    scene_box = shapely.box(0, 0, side, side)
    truth = np.array([shapely.Point(x, y).buffer(r).intersection(scene_box) for x, y, r in discs])
    metrics = evaluate_scene(
        tmp_path / "crowns.parquet",
        raster,
        truth,
        np.zeros(len(truth), dtype=np.int64),
        LABELS,
        {"iou_threshold": 0.5, "score_threshold": 0.3},
        tmp_path / "evaluation.json",
        tmp_path / "quicklook.png",
        manifest_path=tmp_path / "tiles.parquet",
    )
    edge, interior = metrics["edge"], metrics["interior"]
    report(
        f"\n[instances stitching] {len(truth)} crowns, {edge['ground_truth']} across inner tile edges: "
        f"{len(merged)} merged; F1 at tile edges {edge['f1']:.3f}, away from them {interior['f1']:.3f}"
    )
    assert len(tiles) == 16 and edge["ground_truth"] >= 50
    assert len(merged) == len(truth)
    assert min(edge["f1"], interior["f1"]) >= 0.98 and abs(edge["f1"] - interior["f1"]) <= 0.03
