"""A survey's inner borders through the real workflow, at test size (`make bench-project` measures it on the demo's
crowns). A detector and a segmenter are trained by the workflow on a scene of discs (objects they learn in a few
dozen steps); a held-out scene is predicted whole, and cut into 2 x 2 abutting scenes predicted as a project. Near
the inner borders the project's layer scores as the whole scene does, because its seams read across the borders;
the four scenes' own layers side by side, which see the objects there cut, score worse."""

from __future__ import annotations

import sys
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
import pytest
import rasterio
from rasterio.features import rasterize

from conftest import REPO, report
from discs import disc_scene
from workflow import run_workflow

sys.path.append(str(REPO / "bench"))  # the bench's border measures: the test measures what the bench measures
from project_borders import cut, f1_in, inner_borders, max_iou_across_scenes

BAND_M = 2.0  # m either side of an inner border
TILING = {"patch_size": 256, "overlap": 64}
TRAIN = {"scenes": ["train"], "devices": 2, "batch_size": 8, "lr": 0.002, "epochs": 100, "warmup_steps": 5}
TRAIN |= {"validation_fraction": 0, "workers": 0}
PREDICT = {"scenes": "all", "devices": 2, "batch_size": 4, "workers": 0, "accelerator": "cpu"}
SEAMS = ["part_00+part_01", "part_00+part_10", "part_01+part_11", "part_10+part_11"]


def whole_and_project(root: Path, side: int, task: str, model: dict, steps: int) -> tuple[Path, Path]:
    """Train on a 1024 px scene of discs and predict a held-out ``side`` px scene whole (one run), then its 2 x 2
    cut as a project (a second run, with the model file of the first); the two work folders."""
    rasters = root / "rasters"
    rasters.mkdir(parents=True)
    truth = "gpkg" if task == "detection" else "outlines.gpkg"
    train = {"path": str(disc_scene(rasters, "train", 1024, seed=1)), "annotations": str(rasters / f"train.{truth}")}
    heldout = {"path": str(disc_scene(rasters, "heldout", side, seed=7))}
    whole, four = root / "whole", root / "four"
    config = {"task": task, "tiling": TILING, "model": model, "scenes": {"train": train, "heldout": heldout}}
    run_workflow(whole, config | {"train": TRAIN | {"max_steps": steps}, "predict": PREDICT | {"scenes": ["heldout"]}})
    parts = cut(rasters / "heldout.tif", 2, 2, root / "parts")
    model_file = str(whole / f"results/models/{model['name']}.pt")
    run_workflow(four, {"task": task, "tiling": TILING, "model": model | {"file": model_file}, "scenes": parts,
                        "predict": PREDICT})  # fmt: skip
    return whole, four


@pytest.fixture(scope="module")
def detection(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("borders-detection")
    model = {"name": "discs", "backbone": "resnet18", "fpn_channels": 64, "score_threshold": 0.4}
    return root, *whole_and_project(root, 2048, "detection", model, steps=80)


def test_a_2x2_projects_layer_scores_near_its_inner_borders_as_the_whole_scene_with_no_box_twice(detection):
    root, whole, four = detection
    truth = gpd.read_file(root / "rasters/heldout.gpkg")
    scene = gpd.read_parquet(whole / "results/heldout/detections.parquet")
    project = gpd.read_parquet(four / "results/project/detections.parquet")
    apart = pd.concat([gpd.read_parquet(p) for p in sorted((four / "results").glob("part_*/detections.parquet"))])
    band = inner_borders(root / "rasters/heldout.tif", BAND_M)
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


@pytest.fixture(scope="module")
def segmentation(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("borders-segmentation")
    model = {"name": "disc_segmenter", "labels": ["background", "tree"]}
    return root, *whole_and_project(root, 1024, "segmentation", model, steps=40)


def read_on(path: Path, grid: rasterio.DatasetReader, out: np.ndarray) -> None:
    """Write ``path``'s first band into ``out`` where it lies on ``grid`` (same pixel size, whole-pixel offset)."""
    with rasterio.open(path) as src:
        column, row = (round(v) for v in ~grid.transform @ (src.transform.c, src.transform.f))
        out[row : row + src.height, column : column + src.width] = src.read(1)


def mean_iou(classes: np.ndarray, truth: np.ndarray, where: np.ndarray) -> float:
    ious = [((classes == c) & (truth == c))[where].sum() / ((classes == c) | (truth == c))[where].sum() for c in (0, 1)]
    return float(np.mean(ious))


def test_a_2x2_projects_classes_near_its_inner_borders_score_as_the_whole_scenes(segmentation):
    root, whole, four = segmentation
    with rasterio.open(root / "rasters/heldout.tif") as grid:
        outlines = gpd.read_file(root / "rasters/heldout.outlines.gpkg").geometry
        truth = rasterize(outlines, out_shape=grid.shape, transform=grid.transform, dtype="uint8")
        band = rasterize([inner_borders(root / "rasters/heldout.tif", BAND_M)], out_shape=grid.shape,
                         transform=grid.transform, dtype="uint8").astype(bool)  # fmt: skip
        layers = {name: np.full(grid.shape, 255, np.uint8) for name in ("whole scene", "project", "side by side")}
        read_on(whole / "results/heldout/classes.tif", grid, layers["whole scene"])
        read_on(four / "results/project/classes.vrt", grid, layers["project"])
        for part in sorted((four / "results").glob("part_*/classes.tif")):
            read_on(part, grid, layers["side by side"])
    assert not any((classes == 255).any() for classes in layers.values()), "every pixel of the scene has a class"
    scores = {name: mean_iou(classes, truth, band) for name, classes in layers.items()}
    changed = {name: int((classes != layers["whole scene"])[band].sum()) for name, classes in layers.items()}
    report(
        f"\n[borders, segmentation] mIoU within {BAND_M:g} m of the inner borders ({int(band.sum())} px): "
        + ", ".join(f"{name} {scores[name]:.4f} ({changed[name]} px not the whole scene's class)" for name in scores)
    )
    assert truth[band].mean() > 0.2, "discs lie across the borders"
    assert scores["whole scene"] >= 0.9, "the segmenter must find the discs for the comparison to mean anything"
    assert abs(scores["project"] - scores["whole scene"]) <= 0.02
    assert changed["project"] < changed["side by side"] / 2, "the seams should read the borders as the whole scene"
