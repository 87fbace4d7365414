"""A survey's inner borders through the real workflow: one synthetic orthomosaic predicted whole, and cut into 2 x 2
abutting scenes predicted as a project, with a detector the workflow trains. Near the inner borders the project's
layer (its seams read across the borders) scores what the whole scene scores, and no crown is found twice."""

from __future__ import annotations

import geopandas as gpd
import numpy as np
import pandas as pd
import pytest
import rasterio
import shapely
from rasterio.windows import Window

from conftest import report
from rasterscale.raster.geo import box_pairs, pair_ious
from rasterscale.tasks.detection.evaluate import evaluate_detections
from rasterscale.tools.synth import synthesize_scene
from workflow import run_workflow

SIDE = 3072  # px of the held-out orthomosaic (0.1 m): 2 x 2 scenes of 1536 px
BAND = 2.0  # m either side of an inner border
TILING = {"patch_size": 256, "overlap": 64}
MODEL = {"name": "crowns", "backbone": "resnet18", "fpn_channels": 128, "score_threshold": 0.4}
PREDICT = {"scenes": "all", "devices": 1, "batch_size": 8, "workers": 0, "accelerator": "cpu"}


def cut(source, rows: int, columns: int, folder) -> dict[str, dict]:
    """The raster cut into rows x columns abutting GeoTIFFs; their scenes."""
    folder.mkdir(parents=True, exist_ok=True)
    scenes = {}
    with rasterio.open(source) as src:
        height, width = src.height // rows, src.width // columns
        for row in range(rows):
            for column in range(columns):
                window = Window(column * width, row * height, width, height)
                profile = {**src.profile, "width": width, "height": height, "transform": src.window_transform(window)}
                path = folder / f"part_{row}{column}.tif"
                with rasterio.open(path, "w", **profile) as dst:
                    dst.write(src.read(window=window))
                scenes[path.stem] = {"path": str(path)}
    return scenes


@pytest.fixture(scope="module")
def borders(tmp_path_factory):
    root = tmp_path_factory.mktemp("borders")
    train = {
        "scenes": {"train": {"path": "resources/demo/train.tif", "annotations": "resources/demo/train.gpkg"}},
        "demo": {"scenes": {"train": {"width": 2048, "height": 2048, "seed": 1}}},
        "tiling": TILING,
        "model": MODEL,
        "train": {"scenes": ["train"], "devices": 1, "batch_size": 8, "lr": 0.002, "epochs": 20},
    }
    train["train"].update(max_steps=110, warmup_steps=10, workers=0, validation_fraction=0.2)
    run_workflow(root / "train", train)
    model = {**MODEL, "file": str(root / "train/results/models/crowns.pt")}
    synthesize_scene(root / "whole.tif", root / "whole.gpkg", width=SIDE, height=SIDE, seed=7)
    whole = {"scenes": {"whole": {"path": str(root / "whole.tif")}}, "tiling": TILING, "model": model}
    run_workflow(root / "one", {**whole, "predict": PREDICT})
    parts = cut(root / "whole.tif", 2, 2, root / "parts")
    run_workflow(root / "four", {"scenes": parts, "tiling": TILING, "model": model, "predict": PREDICT})
    return root


def inner_borders(path) -> shapely.Geometry:
    """The band of BAND m either side of the 2 x 2 cut's inner borders."""
    with rasterio.open(path) as src:
        b = src.bounds
    x, y = (b.left + b.right) / 2, (b.bottom + b.top) / 2
    lines = shapely.MultiLineString([[(x, b.bottom), (x, b.top)], [(b.left, y), (b.right, y)]])
    return lines.buffer(BAND)


def f1_in(detections: gpd.GeoDataFrame, truth: gpd.GeoDataFrame, area: shapely.Geometry) -> tuple[float, int]:
    """F1 (IoU 0.4, score 0.3: the evaluate section's defaults) of the detections and true crowns centred in
    ``area``; the number of true crowns there."""
    mine = detections[shapely.contains(area, detections.geometry.centroid.values)]
    true = truth[shapely.contains(area, truth.geometry.centroid.values)]
    metrics = evaluate_detections(
        mine.geometry.bounds.to_numpy(),
        mine["score"].to_numpy(),
        np.zeros(len(mine)),
        true.geometry.bounds.to_numpy(),
        np.zeros(len(true)),
        iou_threshold=0.4,
        score_threshold=0.3,
    )
    return metrics["f1"], len(true)


def test_near_inner_borders_the_project_scores_what_the_whole_scene_does_and_finds_no_crown_twice(borders):
    truth = gpd.read_file(borders / "whole.gpkg")
    band = inner_borders(borders / "whole.tif")
    whole = gpd.read_parquet(borders / "one/results/whole/detections.parquet")
    project = gpd.read_parquet(borders / "four/results/project/detections.parquet")
    side_by_side = pd.concat(
        [gpd.read_parquet(path) for path in sorted((borders / "four/results").glob("part_*/detections.parquet"))]
    )
    (f1_whole, crowns), (f1_project, _) = f1_in(whole, truth, band), f1_in(project, truth, band)
    f1_apart, _ = f1_in(gpd.GeoDataFrame(side_by_side, crs=whole.crs), truth, band)
    f1_all_whole, _ = f1_in(whole, truth, shapely.box(*truth.total_bounds).buffer(10))
    report(
        f"project borders: F1 within {BAND} m of the inner borders ({crowns} crowns): whole scene {f1_whole:.3f}, "
        f"project {f1_project:.3f}, the four scenes' layers side by side {f1_apart:.3f} (whole scene overall "
        f"{f1_all_whole:.3f})"
    )
    assert f1_all_whole > 0.8  # a detector worth comparing with
    assert crowns >= 30 and abs(f1_project - f1_whole) <= 0.02
    boxes = project.geometry.bounds.to_numpy()
    i, j = box_pairs(boxes)
    scenes = project["scene"].to_numpy()
    across = scenes[i] != scenes[j]
    worst = pair_ious(boxes[i], boxes[j])[across].max(initial=0.0)
    assert worst <= 0.2, f"boxes of different scenes overlap at IoU {worst:.2f}"
    assert set(project["scene"]) == {"part_00", "part_01", "part_10", "part_11"}
    assert {source for source in project["source"] if "+" in source} == {
        "part_00+part_01",
        "part_00+part_10",
        "part_01+part_11",
        "part_10+part_11",
    }
