import geopandas as gpd
import numpy as np
import pandas as pd
import pytest
from affine import Affine

from rasterscale.grid.manifest import manifest_frame, tile_grid
from rasterscale.jobs.rankfiles import (
    TileAccountingError,
    check_exactly_once,
    check_scene_records,
    read_tile_ids,
    write_rank_record,
)
from rasterscale.raster.geo import box_pairs, pixel_boxes_to_polygons
from rasterscale.tasks.detection.merge import (
    cross_tile_nms,
    empty_detections,
    merge_detections,
    write_detections_file,
)
from rasterscale.tasks.detectors.merge import read_rank_files

TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
CRS = "EPSG:32617"


def detections(rows):
    """rows: (tile_id, score, xmin, ymin, xmax, ymax) in raster pixels."""
    arr = np.array([r[2:] for r in rows], dtype=float).reshape(-1, 4)
    frame = pd.DataFrame(
        {
            "tile_id": [r[0] for r in rows],
            "label": ["tree"] * len(rows),
            "score": np.array([r[1] for r in rows], dtype=np.float32),
            "px_xmin": arr[:, 0],
            "px_ymin": arr[:, 1],
            "px_xmax": arr[:, 2],
            "px_ymax": arr[:, 3],
        }
    )
    return gpd.GeoDataFrame(frame, geometry=pixel_boxes_to_polygons(arr, TRANSFORM), crs=CRS)


@pytest.fixture
def manifest():
    # 700 x 400 raster, 400 px tiles with 100 px overlap -> tiles at col 0 and col 300
    return manifest_frame(tile_grid(700, 400, 400, 100), TRANSFORM, CRS)


def merge(dets, manifest):
    return merge_detections(dets, manifest, 700, 400, iou_threshold=0.4, edge_tolerance=2, containment_threshold=0.6)


def test_object_seen_in_both_overlapping_tiles_is_kept_once(manifest):
    # a crown fully inside the overlap (cols 300..400) is detected by both tiles, slightly differently
    dets = detections([(0, 0.9, 320, 100, 370, 150), (1, 0.8, 321, 101, 371, 149)])
    merged = merge(dets, manifest)
    assert len(merged) == 1 and merged.iloc[0]["score"] == pytest.approx(0.9)


def test_box_cut_by_inner_tile_edge_gives_way_to_the_whole_box(manifest):
    # object spans cols 370..430: tile 0 ends at 400 and sees a truncated box (IoU with the whole one is 0.5);
    # tile 1 (cols 300..700) sees it whole. The truncated box scores higher but must not survive.
    dets = detections([(0, 0.95, 370, 100, 400, 160), (1, 0.7, 370, 100, 430, 160)])
    merged = merge(dets, manifest)
    assert len(merged) == 1
    assert merged.iloc[0][["px_xmin", "px_xmax"]].tolist() == [370, 430]


def test_box_touching_the_raster_edge_is_not_treated_as_cut(manifest):
    dets = detections([(1, 0.9, 660, 10, 700, 60), (1, 0.8, 0 + 600, 300, 640, 340)])
    assert len(merge(dets, manifest)) == 2


def test_distinct_neighbours_survive(manifest):
    dets = detections([(0, 0.9, 100, 100, 150, 150), (0, 0.8, 148, 100, 198, 150), (1, 0.7, 500, 100, 550, 150)])
    assert len(merge(dets, manifest)) == 3


def test_cross_tile_nms_runs_per_overlap_group():
    """NMS compares only the pairs of intersecting boxes (each overlap group on its own, never all pairs): a pair
    left out of the pair list is not compared, and a box of another label or out of every group is kept."""
    boxes = np.array(
        [[0, 0, 10, 10], [1, 0, 11, 10], [100, 100, 110, 110], [101, 100, 111, 110], [500, 0, 510, 10], [2, 0, 12, 10]]
    ).astype(float)
    scores = np.array([0.5, 0.9, 0.9, 0.5, 0.1, 0.3])
    labels = np.array([0, 0, 0, 0, 0, 1])
    assert sorted(cross_tile_nms(boxes, scores, labels, 0.5).tolist()) == [1, 2, 4, 5]
    i, j = box_pairs(boxes)
    assert (0, 1) in set(zip(i.tolist(), j.tolist(), strict=True))
    other = ~((i == 0) & (j == 1))  # the group {0, 1} without its pair: nothing in it is compared
    assert sorted(cross_tile_nms(boxes, scores, labels, 0.5, (i[other], j[other])).tolist()) == [0, 1, 2, 4, 5]


def test_exactly_once_passes_and_names_missing_and_duplicated_tiles():
    ids = np.arange(6)
    check_exactly_once(ids, {"rank-0.parquet": np.array([0, 1, 2]), "rank-1.parquet": np.array([3, 4, 5])})
    with pytest.raises(TileAccountingError, match=r"missing tile_id\(s\) 5"):
        check_exactly_once(ids, {"rank-0.parquet": np.array([0, 1, 2]), "rank-1.parquet": np.array([3, 4])})
    with pytest.raises(TileAccountingError, match=r"duplicated tile_id\(s\) 2 .*rank-0.parquet.*rank-1.parquet"):
        check_exactly_once(ids, {"rank-0.parquet": np.array([0, 1, 2]), "rank-1.parquet": np.array([2, 3, 4, 5])})
    with pytest.raises(TileAccountingError, match="not in the manifest 9"):
        check_exactly_once(ids, {"rank-0.parquet": np.array([0, 1, 2, 3, 4, 5, 9])})


def test_rank_files_roundtrip_keeps_crs_and_processed_tiles(tmp_path):
    path = tmp_path / "rank-0.parquet"
    write_detections_file(detections([(3, 0.9, 10, 10, 20, 20)]), path)
    write_rank_record(tmp_path / "rank-0", [3, 4, 7])
    empty = tmp_path / "rank-1.parquet"
    write_detections_file(empty_detections(CRS), empty)
    write_rank_record(tmp_path / "rank-1", [5])
    assert read_tile_ids(tmp_path / "rank-0").tolist() == [3, 4, 7]
    assert read_tile_ids(tmp_path / "rank-1").tolist() == [5]
    frame = read_rank_files([path, empty], empty_detections)
    assert len(frame) == 1 and frame.crs.to_epsg() == 32617
    check_scene_records([tmp_path / "rank-0", tmp_path / "rank-1"], np.array([3, 4, 5, 7]))
    with pytest.raises(TileAccountingError, match=r"missing tile_id\(s\) 6"):
        check_scene_records([tmp_path / "rank-0", tmp_path / "rank-1"], np.arange(3, 8))
    with pytest.raises(TileAccountingError, match=r"rank-2\.json: rank record missing"):
        check_scene_records([tmp_path / "rank-0", tmp_path / "rank-2"], np.array([3, 4, 7]))
    assert not list(tmp_path.glob(".*tmp*"))


def test_cross_tile_nms_keeps_what_torchvision_nms_keeps():
    import torch
    from torchvision.ops import batched_nms

    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        corner = rng.uniform(0, 300, (n, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(5, 80, (n, 2))], axis=1)
        scores, labels = rng.permutation(n) / n, rng.integers(0, 2, n)  # distinct scores: no ties to break
        threshold = float(rng.uniform(0.1, 0.7))
        expected = batched_nms(torch.tensor(boxes), torch.tensor(scores), torch.tensor(labels), threshold)
        assert sorted(cross_tile_nms(boxes, scores, labels, threshold).tolist()) == sorted(expected.tolist())
