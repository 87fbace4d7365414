"""A survey's inner borders through the real workflow, at test size (`make bench-project` measures it on the demo's
crowns). A detector is trained by the workflow on a scene of discs (objects it learns in a few dozen steps); a
held-out scene is predicted whole, and cut into 2 x 2 abutting scenes predicted as a project. Near the inner
borders the project's layer scores as the whole scene does, because its seams read across the borders; the four
scenes' own layers side by side, which see the objects there cut, score worse. (The same for segmentation, with the
segmentation workflow's trained segmenter: tests/test_segmentation_workflow.py.)"""

from __future__ import annotations

from pathlib import Path

import geopandas as gpd
import pandas as pd
import pytest

from borders import BAND_M, PREDICT, SEAMS, TILING, predict_as_project
from conftest import report
from discs import disc_scene
from project_borders import f1_in, inner_borders, max_iou_across_scenes
from workflow import run_dir, run_paths, run_workflow

TRAIN = {"scenes": ["train"], "devices": 2, "batch_size": 4, "lr": 0.002, "epochs": 100, "max_steps": 80}
TRAIN |= {"warmup_steps": 5, "validation_fraction": 0, "workers": 0}
MODEL = {"name": "discs", "backbone": "resnet18", "fpn_channels": 64, "score_threshold": 0.4}


@pytest.fixture(scope="module")
def detection(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Train on a 1024 px scene of discs and predict a held-out 1792 px scene whole (one run), then its 2 x 2 cut
    as a project (a second run, with the model file of the first): the rasters' folder and the two runs' folders
    (results/discs/ of each work folder)."""
    root = tmp_path_factory.mktemp("borders-detection")
    rasters = root / "rasters"
    rasters.mkdir()
    train = {"path": str(disc_scene(rasters, "train", 1024, seed=1)), "annotations": str(rasters / "train.gpkg")}
    heldout = disc_scene(rasters, "heldout", 1792, seed=7)
    whole = root / "whole"
    scenes = {"train": train, "heldout": {"path": str(heldout)}}
    predict = PREDICT | {"scenes": ["heldout"]}
    config = {"tiling": TILING, "model": MODEL, "scenes": scenes, "train": TRAIN, "predict": predict}
    layer = run_paths(config).scene_file("heldout", "detections.parquet")
    run_workflow(whole, config, layer)  # trains first: no quicklook, no report
    model = MODEL | {"file": str(whole / f"results/models/{MODEL['name']}.pt")}
    return rasters, run_dir(whole, config), predict_as_project(root, heldout, "detection", model, "detections.parquet")


def test_a_2x2_projects_layer_scores_near_its_inner_borders_as_the_whole_scene_with_no_box_twice(detection):
    rasters, whole, four = detection
    truth = gpd.read_file(rasters / "heldout.gpkg")
    assert whole.name == four.name == MODEL["name"]  # both runs' outputs under results/discs/
    scene = gpd.read_parquet(whole / "heldout/detections.parquet")
    project = gpd.read_parquet(four / "project/detections.parquet")
    apart = pd.concat([gpd.read_parquet(p) for p in sorted(four.glob("part_*/detections.parquet"))])
    band = inner_borders(rasters / "heldout.tif", BAND_M)
    (f1_scene, discs), (f1_project, _), (f1_apart, _) = (f1_in(layer, truth, band) for layer in (scene, project, apart))
    overlap = max_iou_across_scenes(project)
    report(
        f"\n[borders, detection] {discs} discs within {BAND_M:g} m of the inner borders: F1 whole scene {f1_scene:.3f},"
        f" project {f1_project:.3f}, the four scenes side by side {f1_apart:.3f}; largest IoU of boxes of different"
        f" scenes in the project {overlap:.3f}"
    )
    assert sorted({source for source in project["source"] if "+" in source}) == SEAMS
    assert discs >= 30 and f1_scene >= 0.8, "the detector must find the discs for the comparison to mean anything"
    assert abs(f1_project - f1_scene) <= 0.02
    assert f1_apart <= f1_scene - 0.05, "objects cut by the borders should cost the scenes side by side"
    assert overlap <= 0.2
