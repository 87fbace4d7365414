"""The points task's project through the real workflow, with a point model that needs no training (an exported
heatmap network whose peaks are the centres of bright blobs: tests/pointblobs.py): a scene of known points cut
into 2 x 2 abutting scenes, blobs on the cut lines included, predicted on 2 ranks with seams. The project's layer
holds every point once, those on the scenes' borders found by the seams that read across them (the scenes' own
layers, each seeing half of such a blob, hold some twice), as a partitioned GeoParquet dataset (above
project.partition_scenes); its summary raster counts them per hectare."""

from __future__ import annotations

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import yaml

from borders import cut  # the bench's cut (bench/project_borders.py)
from pointblobs import ORIGIN, PIXEL, HeatmapNet, blob_centres, blob_scene, export_onnx
from rasterscale.tasks.exported.card import card_path
from workflow import run_dir, run_paths, run_workflow

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 384, 320  # cut at column 192 and row 160
PATCH, OVERLAP = 64, 16
CARD = {"task": "points", "labels": ["tree"], "bands": ["red", "green", "blue", "nir"], "input": "scaled",
        "tile_size": PATCH, "output": "heatmap"}  # fmt: skip


def test_a_surveys_points_are_each_once_in_its_partitioned_project_layer_across_scene_borders(tmp_path):
    centres = blob_centres(WIDTH, HEIGHT, start=10, cut=(192, 160))  # the grid's column 192 and row 160 on the cuts
    on_cuts = np.isin(centres[:, 0], (191, 192)) | np.isin(centres[:, 1], (159, 160))
    assert on_cuts.sum() >= 20  # blobs on the cut lines, either side of them
    parts = cut(blob_scene(tmp_path / "survey.tif", WIDTH, HEIGHT, centres), 2, 2, tmp_path / "parts")
    scenes = {name: {**scene, "bands": [1, 2, 3, 4]} for name, scene in parts.items()}
    model = export_onnx(HeatmapNet().eval(), tmp_path / "tops.onnx", PATCH)
    card_path(model).write_text(yaml.safe_dump(CARD))
    config = {
        "task": "points",
        "scenes": scenes,
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        "model": {"file": str(model), "score_threshold": 0.15, "sigma": 0.3},  # peaks: the highest of 6 px
        "train": {"scenes": []},
        "predict": {"scenes": "all", "devices": 2, "batch_size": 4, "workers": 0, "precision": "32-true"},
        "merge": {"point_distance": 0.5},
        "project": {"partition_scenes": 2, "summary_cell": 8},  # 4 scenes: a partitioned layer
    }
    summary = run_paths(config).project_file("summary.tif")
    run_workflow(tmp_path / "run", config, summary)
    run = run_dir(tmp_path / "run", config)
    log = "".join(path.read_text() for path in (tmp_path / "run/logs/predict").glob("**/*.log"))
    assert "exported onnx file, points: heatmap of [tree]" in log  # its card, checked at dry run
    layer = gpd.read_parquet(run / "project/points")  # the partitions' folder, read as one layer
    assert len(list((run / "project/points").glob("batch-*.parquet"))) >= 1
    expected_xy = np.column_stack(
        [ORIGIN[0] + PIXEL * (centres[:, 0] + 0.5), ORIGIN[1] - PIXEL * (centres[:, 1] + 0.5)]
    )
    found_xy = np.column_stack([layer.geometry.x, layer.geometry.y])
    assert len(layer) == len(centres)  # each point once: none lost on a border, none twice where sources meet
    nearest = np.abs(found_xy[:, None, :] - expected_xy[None, :, :]).max(axis=2)
    assert (nearest.min(axis=1) < 1e-6).all() and (nearest.min(axis=0) < 1e-6).all()  # at the blobs' centres
    border = layer.iloc[np.flatnonzero(on_cuts[nearest.argmin(axis=1)])]
    assert border["source"].str.contains(r"\+").all(), set(border["source"])  # found by the seams
    assert set(layer["scene"]) == set(scenes) and layer.crs == "EPSG:32617"
    with rasterio.open(tmp_path / "run" / summary) as src:  # every point, per hectare
        area = abs(src.res[0] * src.res[1]) / 10_000
        assert src.read(1).sum() * area == pytest.approx(len(layer), rel=1e-4)
    own = [gpd.read_parquet(run / name / "points.parquet") for name in scenes]
    assert sum(map(len, own)) > len(centres)  # side by side, the scenes see a blob cut by a border twice
    print(f"\nproject: {len(layer)} points of {len(centres)} ({on_cuts.sum()} on the cuts); the scenes' own layers: "
          f"{sum(map(len, own))}")  # fmt: skip
