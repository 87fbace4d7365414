"""A scene predicted whole and cut into 2 x 2 abutting scenes predicted as a project, and what is measured in a band
along the inner borders (tests/test_project_borders.py, and the segmentation workflow's trained segmenter in
tests/test_segmentation_workflow.py; `make bench-project` measures the same on the demo's crowns)."""

from __future__ import annotations

import sys
from pathlib import Path

import geopandas as gpd
import numpy as np
import rasterio
from rasterio.features import rasterize

from conftest import REPO
from workflow import run_dir, run_paths, run_workflow

sys.path.append(str(REPO / "bench"))  # the bench's border measures: the tests measure what the bench measures
from project_borders import cut, inner_borders

BAND_M = 2.0  # m either side of an inner border
TILING = {"patch_size": 256, "overlap": 64}
PREDICT = {"scenes": "all", "devices": 2, "batch_size": 4, "workers": 0, "accelerator": "cpu"}
SEAMS = ["part_00+part_01", "part_00+part_10", "part_01+part_11", "part_10+part_11"]


def predict_as_project(
    root: Path, raster: Path, task: str, model: dict, layer: str, bands: list[int] | None = None
) -> Path:
    """``raster`` cut into 2 x 2 abutting scenes (each read as ``bands``, None: the default), predicted as a project
    with ``model`` (its ``file`` set) in ``root/four`` up to the project's ``layer`` (no quicklooks or report pages);
    the run's folder there (``root/four/results/{run}``: the scenes' folders and the project's)."""
    parts = cut(raster, 2, 2, root / "parts")
    if bands is not None:
        parts = {name: {**scene, "bands": bands} for name, scene in parts.items()}
    four = root / "four"
    config = {"task": task, "tiling": TILING, "model": model, "scenes": parts, "predict": PREDICT}
    run_workflow(four, config, run_paths(config).project_file(layer))
    return run_dir(four, config)


def read_on(path: Path, grid: rasterio.DatasetReader, out: np.ndarray) -> None:
    """Write ``path``'s first band into ``out`` where it lies on ``grid`` (same pixel size, whole-pixel offset)."""
    with rasterio.open(path) as src:
        column, row = (round(v) for v in ~grid.transform @ (src.transform.c, src.transform.f))
        out[row : row + src.height, column : column + src.width] = src.read(1)


def mean_iou(classes: np.ndarray, truth: np.ndarray, where: np.ndarray) -> float:
    ious = [((classes == c) & (truth == c))[where].sum() / ((classes == c) | (truth == c))[where].sum() for c in (0, 1)]
    return float(np.mean(ious))


def class_maps_near_borders(raster: Path, outlines: Path, whole: Path, four: Path) -> tuple[dict, dict, int, float]:
    """Within ``BAND_M`` of the inner borders: the mIoU of the whole scene's classes (``whole``), the project's
    and the four scenes' side by side (``four``: their run's folder, :func:`predict_as_project`); how many pixels
    of each differ from the whole scene's; the band's pixels; the fraction of them that are objects."""
    with rasterio.open(raster) as grid:
        truth = rasterize(gpd.read_file(outlines).geometry, out_shape=grid.shape, transform=grid.transform)
        band = rasterize([inner_borders(raster, BAND_M)], out_shape=grid.shape, transform=grid.transform) == 1
        layers = {name: np.full(grid.shape, 255, np.uint8) for name in ("whole scene", "project", "side by side")}
        read_on(whole, grid, layers["whole scene"])
        read_on(four / "project/classes.vrt", grid, layers["project"])
        for part in sorted(four.glob("part_*/classes.tif")):
            read_on(part, grid, layers["side by side"])
    assert not any((classes == 255).any() for classes in layers.values()), "every pixel of the scene has a class"
    scores = {name: mean_iou(classes, truth, band) for name, classes in layers.items()}
    changed = {name: int((classes != layers["whole scene"])[band].sum()) for name, classes in layers.items()}
    return scores, changed, int(band.sum()), float(truth[band].mean())
