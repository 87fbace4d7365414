"""Imagery and annotations as users hold them, through real `snakemake` runs: a multispectral drone's orthomosaic
(red, green, blue, near infrared and alpha) with a masked corner and DeepForest CSV boxes to train a 4-band
detector on, a 16-bit one with Pascal VOC boxes to predict and score; and the dry run's one-line errors."""

import json

import geopandas as gpd
import numpy as np
import pyarrow.parquet as pq
import pytest
import rasterio

import snakemake_forks
from conftest import write_raster, write_rgba
from rasterscale.grid.manifest import tile_grid
from rasterscale.raster.bands import scaled_input
from rasterscale.raster.geo import geometries_to_pixel_boxes
from rasterscale.raster.imagery import SPEC_KEY
from rasterscale.tasks.detection.modelfiles import read_header
from rasterscale.tools.synth import synthesize_scene
from workflow import rank_stems, run_dir, run_paths, run_workflow, tiny_config, workflow_command

pytestmark = pytest.mark.slow

CORNER = 300  # the masked top-left square (alpha 0), in pixels
PATCH, OVERLAP = 256, 64
BANDS = [1, 2, 3, 4]  # red, green, blue, near infrared (band 5: alpha)
RUN = "results/tiny"  # the run of the tiny config (model.name tiny)


def masked_scene(directory, name, width, height, seed, dtype="uint8", boxes_in_corner=False):
    """A synthetic canopy scene as an RGBN + alpha orthomosaic whose top-left corner is masked (the bands there:
    white, as some tools write), and its crown boxes in pixels (outside the corner unless asked: training drops
    them)."""
    synthesize_scene(
        directory / f"{name}.rgbn.tif", directory / f"{name}.gpkg", width=width, height=height, seed=seed, nir=True
    )
    with rasterio.open(directory / f"{name}.rgbn.tif") as src:
        rgb, transform = src.read(), src.transform
    boxes = geometries_to_pixel_boxes(gpd.read_file(directory / f"{name}.gpkg").geometry.to_numpy(), transform)
    centres = (boxes[:, :2] + boxes[:, 2:]) / 2
    if not boxes_in_corner:
        boxes = boxes[(centres >= CORNER).any(axis=1)]
    data = np.concatenate([rgb, np.full((1, height, width), 255, np.uint8)])
    data[:4, :CORNER, :CORNER] = 255
    data[4, :CORNER, :CORNER] = 0
    if dtype == "uint16":
        data = data.astype(np.uint16) * 257
    path = write_rgba(directory / f"{name}.tif", data, transform=transform)
    return path, np.round(boxes).astype(int)


def write_csv(path, image, boxes):
    rows = [f"{image},{x0},{y0},{x1},{y1},Tree" for x0, y0, x1, y1 in boxes]
    rows += ["some_other_tile.tif,1,1,20,20,Tree"] * 3
    path.write_text("image_path,xmin,ymin,xmax,ymax,label\n" + "\n".join(rows) + "\n")
    return path


def write_voc(path, image, boxes):
    objects = "".join(
        f"<object><name>Tree</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax>"
        "</bndbox></object>"
        for x0, y0, x1, y1 in boxes
    )
    path.write_text(f"<annotation><filename>{image}</filename>{objects}</annotation>")
    return path


def user_config(directory):
    data = directory / "data"
    data.mkdir(parents=True)
    train, train_boxes = masked_scene(data, "odm_train", 768, 768, seed=11, boxes_in_corner=True)
    test, test_boxes = masked_scene(data, "ortho16", 900, 700, seed=12, dtype="uint16")
    scenes = {
        "odm_train": {
            "path": str(train),
            "annotations": str(write_csv(data / "boxes.csv", train.name, train_boxes)),
            "bands": BANDS,
        },
        "ortho16": {
            "path": str(test),
            "annotations": str(write_voc(data / "ortho16.xml", test.name, test_boxes)),
            "scale": {"min": 0, "max": 65535},
            "bands": BANDS,
        },
    }
    # DeepForest's CSV and VOC say Tree; model.labels is left at its default, [tree]: matched whatever the case
    model = {"band_names": ["red", "green", "blue", "nir"]}
    config = tiny_config(model=model, train={"scenes": ["odm_train"]}, predict={"scenes": ["ortho16"]})
    return config | {"scenes": scenes, "demo": {}}


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """The run in its work folder: the work folder and snakemake's result."""
    workdir = tmp_path_factory.mktemp("user_imagery")
    config = user_config(workdir)
    assert run_dir(workdir, config) == workdir / RUN
    result = run_workflow(workdir, config, run_paths(config).batch_record("score", 0))  # not the report's pages
    return workdir, result


def test_manifests_skip_wholly_masked_tiles_and_hold_the_spec(user_run):
    workdir, _ = user_run
    manifest = workdir / RUN / "ortho16/tiles.parquet"
    tiles = gpd.read_parquet(manifest)
    grid = tile_grid(900, 700, PATCH, OVERLAP)
    inside = (grid[:, 0] + grid[:, 2] <= CORNER) & (grid[:, 1] + grid[:, 3] <= CORNER)
    assert inside.sum() == 1 and len(tiles) == len(grid) - 1  # the (0, 0) tile is wholly masked
    assert not ((tiles.col_off == 0) & (tiles.row_off == 0)).any()
    spec = json.loads(pq.read_schema(manifest).metadata[SPEC_KEY])
    assert (spec["mask"], spec["alpha"], spec["low"], spec["high"]) == ("alpha", 5, [0] * 4, [65535] * 4)
    assert spec["bands"] == BANDS and not spec["raw"]
    assert "mask alpha (band 5), scale declared" in (workdir / "logs/tiles/batch-0.log").read_text()


def test_the_masked_corner_gets_no_detections(user_run):
    workdir, _ = user_run
    detections = gpd.read_parquet(workdir / RUN / "ortho16/detections.parquet")
    assert len(detections) > 20  # an almost untrained model at score 0.05: boxes everywhere else
    cx = (detections.px_xmin + detections.px_xmax) / 2
    cy = (detections.px_ymin + detections.px_ymax) / 2
    assert not ((cx < CORNER) & (cy < CORNER)).any()
    # tiles partly masked saw "objects" in the fill; the merge dropped those centred on masked pixels
    ranks = [gpd.read_parquet(stem.with_suffix(".parquet")) for stem in rank_stems(workdir / RUN, "ortho16")]
    assert ranks
    in_corner = [(((r.px_xmin + r.px_xmax) / 2 < CORNER) & ((r.px_ymin + r.px_ymax) / 2 < CORNER)).sum() for r in ranks]
    assert sum(in_corner) > 0


def test_csv_rows_of_other_images_are_counted_in_the_log_and_voc_scores(user_run):
    """DeepForest's CSV (and VOC) label, Tree, trains and scores the default model.labels, [tree]: the model keeps
    its own spelling."""
    workdir, _ = user_run
    log = (workdir / "logs/train/tiny.log").read_text()
    assert "boxes.csv: 3 box(es) of other images than odm_train.tif ignored" in log
    assert "Tree -> tree" in log
    header = read_header(workdir / "results/models/tiny.pt")
    assert header.input == scaled_input(["red", "green", "blue", "nir"]) and header.labels == ("tree",)
    metrics = json.loads((workdir / RUN / "ortho16/evaluation.json").read_text())
    assert metrics["ground_truth"] > 0 and {"precision", "recall", "f1"} <= set(metrics)


def dry_run_error(tmp_path, scene):
    config = {"scenes": {"ortho": scene}}  # every scene is checked at load, used or not
    result = snakemake_forks.run(workflow_command(tmp_path, config, "-n"))
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_16_bit_without_scale_fails_the_dry_run_naming_the_key(tmp_path):
    path = write_raster(tmp_path / "ortho16.tif", 64, 64, data=np.zeros((3, 64, 64), np.uint16))
    line = dry_run_error(tmp_path / "run", {"path": str(path)})
    assert line.startswith(f"rasterscale: {path}: bands are uint16, not uint8; set scenes.ortho.scale")


def test_bands_out_of_range_and_bad_scale_fail_the_dry_run(tmp_path):
    path = write_raster(tmp_path / "four.tif", 64, 64, count=4, data=np.zeros((4, 64, 64), np.uint16))
    line = dry_run_error(tmp_path / "bands", {"path": str(path), "bands": [5, 2, 1], "scale": {"percentile": [2, 98]}})
    assert "raster has 4 band(s); scenes.ortho.bands [5, 2, 1] asks for band(s) 5" in line
    line = dry_run_error(tmp_path / "scale", {"path": str(path), "scale": {"min": [0, 0], "max": 9}})
    assert "scenes.ortho.scale.min has 2 value(s) for the 3 bands of scenes.ortho.bands" in line
