"""Inputs as a hostile new user brings them, through the real workflow: each bad input stops `snakemake -n` with
one line naming the file (or key), the problem and the fix, and no traceback; pixels that only decoding finds
bad fail the predicting rank with one line naming the raster and the tile (a real run, with spaces in every path).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import shapely

import snakemake_forks
from conftest import REPO, damage_block, write_raster
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import check_imagery
from rasterscale.settings import settings_of
from rasterscale.tasks.detection.groundtruth import read_annotations
from rasterscale.tasks.detection.modelfiles import detector_of_config, read_header
from rasterscale.tasks.labels import label_indexes
from rasterscale.tasks.registry import task_spec
from rasterscale.tasks.segmentation.groundtruth import check_segmentation_truth
from rasterscale.workflow.checks import build_plan
from workflow import workflow_command

PATCH, OVERLAP = 128, 32
TRANSFORM = rasterio.Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)


def write_boxes(path: Path, shift: float = 0.0) -> Path:
    boxes = [
        shapely.box(404002 + shift + 3 * k, 3284990 + shift, 404004 + shift + 3 * k, 3284992 + shift) for k in range(5)
    ]
    gpd.GeoDataFrame({"label": ["tree"] * 5}, geometry=boxes, crs="EPSG:32617").to_file(path)
    return path


def deflate_raster(path: Path, width: int, height: int, count: int = 3, **kwargs) -> Path:
    data = np.random.default_rng(1).integers(0, 255, size=(count, height, width), dtype=np.uint8)
    data[:, :, : width // 2] = 90  # half compressible: blocks of unequal sizes, as real imagery
    profile = dict(driver="GTiff", width=width, height=height, count=count, dtype="uint8", crs="EPSG:32617")
    profile.update(transform=TRANSFORM, tiled=True, blockxsize=128, blockysize=128, compress="deflate", **kwargs)
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(data)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Real files: a training scene and its boxes, a scene to predict, and the hostile inputs."""
    folder = tmp_path_factory.mktemp("hostile")
    deflate_raster(folder / "train.tif", 512, 512)
    deflate_raster(folder / "test.tif", 384, 256)
    write_boxes(folder / "train.gpkg")
    write_boxes(folder / "far.gpkg", shift=5000.0)
    shutil.copy(folder / "test.tif", folder / "late.tif")
    damage_block(folder / "late.tif", 2, 1, truncate=True)
    (folder / "header.tif").write_bytes((folder / "test.tif").read_bytes()[:200])
    write_raster(folder / "float.tif", 64, 64, data=np.zeros((3, 64, 64), np.float32))
    deflate_raster(folder / "rgbn.tif", 64, 64, count=4, photometric="MINISBLACK")  # no band marked alpha
    write_raster(folder / "small.tif", 512, 300)
    (folder / "text.pt").write_text("not a model\n")
    write_hostile_crowns(folder)
    heights = np.linspace(0, 30, 512 * 512, dtype=np.float32).reshape(1, 512, 512)
    write_raster(folder / "heights.tif", 512, 512, count=1, data=heights, transform=TRANSFORM)  # regression's target
    return folder


def write_crowns(path: Path, geometries: list) -> None:
    frame = gpd.GeoDataFrame({"label": ["tree"] * len(geometries)}, geometry=geometries, crs="EPSG:32617")
    frame.to_file(path)


def write_hostile_crowns(folder: Path) -> None:
    """Crown polygons of train.tif, each file with one bad feature (its 5th) or bad throughout; a COCO file with an
    annotation of an unknown category."""
    x, y = 404002, 3284990
    good = [shapely.box(x + 3 * k, y, x + 2 + 3 * k, y + 2) for k in range(4)]
    write_crowns(
        folder / "bowtie.gpkg", [*good, shapely.Polygon([(x, y - 5), (x + 2, y - 3), (x + 2, y - 5), (x, y - 3)])]
    )
    parts = [shapely.box(x, y - 9, x + 1, y - 8), shapely.box(x + 3, y - 9, x + 4, y - 8)]
    write_crowns(folder / "multi.gpkg", [*good, shapely.MultiPolygon(parts)])
    write_crowns(folder / "empty.gpkg", [*good, shapely.Polygon()])
    write_crowns(folder / "points.gpkg", [shapely.Point(x + k, y) for k in range(4)])
    coco = {
        "images": [{"id": 1, "file_name": "train.tif", "width": 512, "height": 512}],
        "categories": [{"id": 1, "name": "tree"}],
        "annotations": [
            {"id": 7, "image_id": 1, "category_id": 1, "segmentation": [[10, 10, 30, 10, 30, 30, 10, 30]]},
            {"id": 8, "image_id": 1, "category_id": 5, "segmentation": [[40, 40, 60, 40, 60, 60]]},
        ],
    }
    (folder / "coco.json").write_text(json.dumps(coco))


def crowns_config(data: Path, annotations: str, task: str = "instances") -> dict:
    """The training scene annotated with ``annotations`` (a file of the data folder), under ``task``."""
    scenes = config_of(data)["scenes"]
    return config_of(
        data, task, scenes={**scenes, "train": {**scenes["train"], "annotations": str(data / annotations)}}
    )


def tree_tops_config(data: Path, tree_tops: str) -> dict:
    """Regression of heights.tif on the training scene, its true tree tops ``tree_tops`` (a file of the data
    folder), scored on the tops merge.tree_tops finds."""
    config = config_of(data, "regression", merge={"tree_tops": {"min_height": 2}})
    del config["model"]  # regression's defaults
    train = {**config["scenes"]["train"], "annotations": str(data / "heights.tif")}
    config["scenes"] = {**config["scenes"], "train": {**train, "tree_tops": str(data / tree_tops)}}
    return config


def config_of(data: Path, task: str = "detection", **sections: dict) -> dict:
    """A config training on train.tif and predicting test.tif; ``sections`` update its sections."""
    config = {
        "task": task,
        "scenes": {
            "train": {"path": str(data / "train.tif"), "annotations": str(data / "train.gpkg")},
            "test": {"path": str(data / "test.tif")},
        },
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        "model": {"labels": ["background", "tree"]} if task == "segmentation" else {"backbone": "resnet18"},
        "train": {"scenes": ["train"], "devices": 1, "validation_fraction": 0.3},
        "predict": {"scenes": ["test"], "devices": 1, "workers": 0},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def dry_run(workdir: Path, config: dict, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return snakemake_forks.run([*prefix, *workflow_command(workdir, config, "-n")])


def the_one_line(result: subprocess.CompletedProcess) -> str:
    """The failed run's one `rasterscale:` line; no traceback, no other error line."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr and 'File "' not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


# case -> (config of the data folder D, the expected line with D for the folder)
CASES = {
    "GeoTIFF cut halfway (late blocks)": (
        lambda d: config_of(d, scenes={**config_of(d)["scenes"], "test": {"path": str(d / "late.tif")}}),
        "rasterscale: D/late.tif: GeoTIFF is truncated: the file has \\d+ bytes but its blocks reach byte \\d+ "
        "\\(an interrupted copy or download\\?\\); copy it again",
    ),
    "4 bands, no alpha, no bands key": (
        lambda d: config_of(d, scenes={**config_of(d)["scenes"], "test": {"path": str(d / "rgbn.tif")}}),
        "rasterscale: D/rgbn.tif: raster has 4 bands; set scenes.test.bands to the \\(1-based\\) bands the model "
        "sees, e.g. \\[1, 2, 3\\] for red, green, blue or \\[1, 2, 3, 4\\] for all",
    ),
    "a band beyond the raster's count": (
        lambda d: config_of(
            d, scenes={**config_of(d)["scenes"], "test": {"path": str(d / "test.tif"), "bands": [1, 2, 5]}}
        ),
        "rasterscale: D/test.tif: raster has 3 band\\(s\\); scenes.test.bands \\[1, 2, 5\\] asks for band\\(s\\) 5 "
        "\\(bands are 1..3\\)",
    ),
    "training scene too small for its validation band": (
        lambda d: config_of(
            d,
            scenes={
                **config_of(d)["scenes"],
                "train": {**config_of(d)["scenes"]["train"], "path": str(d / "small.tif")},
            },
        ),
        "rasterscale: D/small.tif: training scene train is 300 px high: its validation band "
        "\\(train.validation_fraction 0.3, the bottom 90 px\\) holds no whole 128 px tile, so validation would never "
        "run; set train.validation_fraction to at least 0.43, or 0 to train without validation",
    ),
    "a text file as model.file (was a traceback)": (
        lambda d: config_of(d, model={"file": str(d / "text.pt")}, train={"scenes": []}),
        "rasterscale: D/text.pt: not a model file rasterscale reads \\(a rasterscale .pt file, .*\\)",
    ),
    "crowns: a self-intersecting polygon (a bow-tie)": (
        lambda d: crowns_config(d, "bowtie.gpkg"),
        "rasterscale: D/bowtie.gpkg: feature 5 is an invalid polygon \\(Self-intersection.*\\) that does not mend "
        "into one polygon \\(a bow-tie is two objects\\): redraw it, or split it into its parts",
    ),
    "crowns: a multipolygon": (
        lambda d: crowns_config(d, "multi.gpkg"),
        "rasterscale: D/multi.gpkg: feature 5 is a MultiPolygon of 2 parts \\(1 such\\); a crown is one polygon: "
        "explode them if they are several crowns, or draw each as one polygon",
    ),
    "crowns: an empty geometry": (
        lambda d: crowns_config(d, "empty.gpkg"),
        "rasterscale: D/empty.gpkg: feature 5 has an empty geometry \\(1 such\\); crowns need polygons .*",
    ),
    "crowns: points (tree tops)": (
        lambda d: crowns_config(d, "points.gpkg"),
        "rasterscale: D/points.gpkg: feature 1 is a Point \\(4 of 4 features are no polygons\\); crowns need "
        "polygons \\(a crown's outline\\)",
    ),
    "crowns: COCO with an unknown category": (
        lambda d: crowns_config(d, "coco.json"),
        "rasterscale: D/coco.json: annotation 8 has category_id 5, not among categories \\(1 tree\\)",
    ),
    "detection boxes: points (tree tops), which trained on zero-area boxes": (
        lambda d: crowns_config(d, "points.gpkg", task="detection"),
        "rasterscale: D/points.gpkg: feature 1 is a Point \\(4 of 4 features are no polygons\\); detection boxes "
        "need polygons \\(a box or an outline\\)",
    ),
    "segmentation polygons: points (tree tops), which only training refused": (
        lambda d: crowns_config(d, "points.gpkg", task="segmentation"),
        "rasterscale: D/points.gpkg: feature 1 is a Point \\(4 of 4 features are no polygons\\); segmentation needs "
        "polygons in a vector file with a CRS, or a class raster on the scene's grid",
    ),
    "regression tree tops: polygons (crowns), which only scoring refused": (
        lambda d: tree_tops_config(d, "train.gpkg"),
        "rasterscale: D/train.gpkg: feature 1 is a Polygon \\(5 of 5 features are no points\\); tree tops need "
        "points \\(one per tree\\)",
    ),
    "nothing to train or predict": (
        lambda d: config_of(d, train={"scenes": []}, predict={"scenes": []}),
        "rasterscale: config: train.scenes and predict.scenes are both empty \\(scenes: test, train\\): nothing to "
        "do; name the scenes to train on or predict",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_stops_the_dry_run_in_one_line(data, tmp_path, case):
    make, expected = CASES[case]
    line = the_one_line(dry_run(tmp_path / "run", make(data)))
    assert re.fullmatch(expected.replace("D/", re.escape(str(data)) + "/"), line), line


def test_a_results_folder_that_is_not_writable_stops_the_dry_run(data, tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: drop its capabilities, as a user's process has none
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no way to be refused a write")
        prefix = ("setpriv", "--inh-caps=-all", "--bounding-set=-all")
    else:
        prefix = ()
    workdir = tmp_path / "run"
    (workdir / "results").mkdir(parents=True)
    (workdir / "results").chmod(0o555)
    try:
        line = the_one_line(dry_run(workdir, config_of(data), prefix))
    finally:
        (workdir / "results").chmod(0o755)
    assert line == (
        f"rasterscale: {workdir / 'results'}: folder is not writable, and the workflow writes into it; make it "
        "writable (chmod u+w), or run in a folder you can write (--directory)"
    )


def test_config_and_ground_truth_checks_of_the_dry_run(data):
    """The dry run's checks that need no workflow to show (each is one line, as the cases above)."""
    base = config_of(data)
    for sections, message in [
        ({"predict": {"scenes": ["test", "test"]}}, "key 'predict.scenes' names scene 'test' twice: list each"),
        ({"train": {"scenes": ["train", "train"]}}, "key 'train.scenes' names scene 'train' twice"),
        ({"model": {"labels": ["tree", "Tree"]}}, "key 'model.labels' names class 'Tree' twice \\(tree, Tree\\)"),
        ({"train": {"max_steps": 0}}, "key 'train.max_steps' is 0: -1 \\(no limit, train.epochs decide\\) or at"),
        ({"model": {"file": "m.pt"}}, "model.file and train.scenes are both set, and model.file is predicted"),
    ]:
        with pytest.raises(ConfigError, match=f"^config: {message}"):
            validate_config({**base, **{k: {**base[k], **v} for k, v in sections.items()}})
    notices = []
    validate_config({**base, "predict": {**base["predict"], "scenes": ["train"]}}, notices=notices)
    assert notices == [
        "scene train is trained on (train.scenes) and predicted and scored (predict.scenes): "
        "results/detector/train/evaluation.json scores the model on its own training data"  # the run: detector
    ]
    with pytest.raises(InputError, match=r"far.gpkg: no polygon overlaps the raster .*train.tif"):
        check_segmentation_truth(data / "far.gpkg", data / "train.tif", ["background", "tree"])
    check_segmentation_truth(data / "train.gpkg", data / "train.tif", ["background", "tree"])


@pytest.fixture(scope="module")
def detector_file(data) -> Path:
    """A real (untrained) rasterscale detector model file, in a folder with a space in its name."""
    import torch

    from rasterscale.tasks.detection.model import build_detector, save_detector
    from rasterscale.tasks.detection.modelfiles import DetectorConfig, write_deepforest_folder

    folder = data / "my models"
    folder.mkdir()
    cfg = DetectorConfig(backbone="resnet18", labels=("tree", "shrub"), patch_size=PATCH)
    torch.manual_seed(0)
    model = build_detector(cfg)
    save_detector(model, cfg, folder / "my model.pt")
    write_deepforest_folder(model.state_dict(), cfg, folder / "deepforest")
    return folder / "my model.pt"


def test_rasters_and_model_files_that_fail_from_their_headers(data, detector_file, tmp_path):
    """Checks the dry run makes (the cases above show their wiring): one InputError line naming the file."""
    with pytest.raises(InputError, match=r"header.tif: not a readable raster \("):
        check_raster(data / "header.tif")
    with pytest.raises(InputError, match=r"float.tif: bands are float32, not uint8; set scenes.a.scale"):
        check_imagery(check_raster(data / "float.tif"), None, None, "scenes.a")
    half = tmp_path / "half.pt"
    half.write_bytes(detector_file.read_bytes()[: detector_file.stat().st_size // 2])
    for path in (data / "text.pt", half):
        with pytest.raises(InputError, match=f"^{re.escape(str(path))}: not a model file rasterscale reads \\("):
            read_header(path)
    cut = tmp_path / "deepforest"
    shutil.copytree(detector_file.parent / "deepforest", cut)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(InputError, match=r"model.safetensors: unreadable weights \(.*\); copy or download them again"):
        read_header(cut)
    other = validate_config({"model": {"file": str(detector_file), "labels": ["shrub", "tree"]}})
    with pytest.raises(
        ConfigError, match=r"'model.labels' is \[shrub, tree\] but .*my model.pt predicts \[tree, shrub\]"
    ):
        detector_of_config(settings_of(other))
    same = settings_of(validate_config({"model": {"file": str(detector_file), "labels": ["Tree", "Shrub"]}}))
    assert detector_of_config(same)[0].labels == ("Tree", "Shrub")  # the file's classes, named as the user does


def test_header_truncation_is_told_from_a_late_cut_only(data, tmp_path):
    check_raster(data / "test.tif")  # whole
    shutil.copy(data / "test.tif", tmp_path / "noise.tif")
    damage_block(tmp_path / "noise.tif", 2, 1)  # damaged bytes, whole length: only decoding finds it
    check_raster(tmp_path / "noise.tif")
    with pytest.raises(InputError, match="GeoTIFF is truncated"):
        check_raster(data / "late.tif")


def test_every_path_in_every_shell_command_is_quoted():
    """Inputs, outputs, logs and folders in the rules' commands are `{...:q}`: a path with a space is one
    argument (the real run below has spaces in every path)."""
    unquoted = [
        (path.name, match.group(0))
        for path in sorted((REPO / "rules").glob("*.smk"))
        for match in re.finditer(r"\{(input|output|log|params\.\w*(dir|path|crs)\w*)(\.\w+)?\}", path.read_text())
    ]
    assert unquoted == []


def test_a_block_that_will_not_decode_fails_the_rank_in_one_line_naming_the_tile(data, detector_file, tmp_path):
    """A real run, with spaces in the working directory, the raster's and the model file's paths: the damaged
    block fails prediction with one line naming the raster and the tile; the rank's log has the traceback."""
    folder = tmp_path / "my data"
    folder.mkdir()
    raster = folder / "damaged scene.tif"
    shutil.copy(data / "test.tif", raster)
    damage_block(raster, 2, 1)  # cols 256-384, rows 128-256: tiles 6, 7, 10 and 11
    config = config_of(
        data,
        scenes={"damaged": {"path": str(raster)}},
        model={"file": str(detector_file), "backbone": None},
        train={"scenes": []},
        predict={"scenes": ["damaged"], "workers": 1, "batch_size": 2},
    )
    workdir = tmp_path / "my run"
    result = snakemake_forks.run(workflow_command(workdir, config, "--cores", "2"))
    assert result.returncode != 0 and "Error in rule predict" in result.stderr, result.stderr
    job_log = (workdir / "logs/predict/batch-0/shard-0.log").read_text()
    lines = [line for line in job_log.splitlines() if line.startswith("rasterscale:")]
    rank_log = workdir / "logs/predict/batch-0/shard-0/rank-0.log"
    assert len(lines) == 1 and "Traceback" not in job_log, job_log
    expected = (
        f"rasterscale: rank 0: {re.escape(str(raster))}: tile (6|7|10|11) "
        "\\(window col \\d+, row \\d+, 128 x 128 px\\) "
        "will not decode \\(.*\\); the file is damaged: copy or export it again "
        f"\\(traceback in {re.escape(str(rank_log))}\\)"
    )
    assert re.fullmatch(
        expected,
        lines[0],
    ), lines[0]
    assert "Traceback" in rank_log.read_text()


def test_a_mask_block_that_will_not_decode_fails_the_tile_manifest_in_one_line(data, detector_file, tmp_path):
    """An RGBA orthomosaic (as OpenDroneMap writes it) with a damaged block: the tile manifest, which reads its
    alpha band to skip empty tiles, fails with one line naming the raster, and no traceback (was GDAL's)."""
    raster = tmp_path / "odm orthophoto.tif"
    deflate_raster(raster, 384, 256, count=4, photometric="RGB", alpha="YES")
    damage_block(raster, 2, 1)
    config = config_of(
        data,
        scenes={"odm": {"path": str(raster)}},
        model={"file": str(detector_file), "backbone": None},
        train={"scenes": []},
        predict={"scenes": ["odm"]},
    )
    workdir = tmp_path / "run"
    target = "results/my_model/odm/tiles.parquet"  # the run of model.file "my model.pt" (no model.name): my_model
    result = snakemake_forks.run(workflow_command(workdir, config, "--cores", "1", target))
    assert result.returncode != 0 and "Error in rule tiles_batch_0" in result.stderr, result.stderr
    log = (workdir / "logs/tiles/batch-0.log").read_text()
    lines = [line for line in log.splitlines() if line.startswith("rasterscale:")]
    assert len(lines) == 1 and "Traceback" not in log, log
    expected = (
        f"rasterscale: {re.escape(str(raster))}: a decimated read of the whole raster will not decode \\(.*\\); "
        "the file is damaged: copy or export it again"
    )
    assert re.fullmatch(expected, lines[0]), lines[0]
    assert not (workdir / target).exists()


def test_bands_and_normalization_that_cannot_work_stop_the_plan_in_one_line(data, detector_file, tmp_path):
    """What the dry run checks of bands and normalization (build_plan is what `snakemake -n` runs; the cases above
    show its wiring): a zero or negative std, `auto` on a scene that is not trained on (with a model file, and in a
    run that trains on another scene), an RGB model file given a 4-band scene."""
    base = config_of(data)
    rgbn = {"path": str(data / "rgbn.tif"), "bands": [1, 2, 3, 4]}
    cases = [
        (
            {"model": {"normalize": {"mean": [90, 90, 90], "std": [30, 0, 30]}}},
            ConfigError,
            "config: key 'model.normalize.std' is 0 for band 2: a std must be positive",
        ),
        (
            {
                "scenes": {
                    **base["scenes"],
                    "train": {**base["scenes"]["train"], "normalize": {"mean": [1] * 3, "std": [-2] * 3}},
                }
            },
            ConfigError,
            "config: key 'scenes.train.normalize.std' is -2 for band 1: a std must be positive",
        ),
        (
            {
                "scenes": {**base["scenes"], "test": {**base["scenes"]["test"], "normalize": "auto"}},
                "model": {"file": str(detector_file)},
                "train": {"scenes": []},
            },
            ConfigError,
            "config: key 'scenes.test.normalize' is set on a scene that is only predicted: the model's own statistics "
            "are used (3 band(s) [red, green, blue], scaled to 0-255, mean [0.485, 0.456, 0.406], std [0.229, 0.224, "
            "0.225]); normalize: auto computes them from training scenes (set it on those, or model.normalize)",
        ),
        (
            {"scenes": {"test": rgbn}, "model": {"file": str(detector_file)}, "train": {"scenes": []}},
            ConfigError,
            f"{data / 'rgbn.tif'}: scenes.test.bands gives 4 band(s) but {detector_file} takes 3 [red, green, blue]; "
            "set scenes.test.bands to 3 bands",
        ),
        (
            {"scenes": {**base["scenes"], "test": {**base["scenes"]["test"], "normalize": "auto"}}},
            ConfigError,
            "config: key 'scenes.test.normalize' is set on a scene that is only predicted: the model's own statistics "
            "are used (3 band(s) [red, green, blue], scaled to 0-255, mean [0.485, 0.456, 0.406], std [0.229, 0.224, "
            "0.225]); normalize: auto computes them from training scenes (set it on those, or model.normalize)",
        ),
    ]
    for sections, error, message in cases:
        config = {**base, **{k: {**base[k], **v} if k != "scenes" else v for k, v in sections.items()}}
        with pytest.raises(error) as raised:
            build_plan(config, tmp_path)
        assert str(raised.value) == message


def test_regression_targets_and_tree_tops_that_cannot_work_stop_the_plan_in_one_line(data, tmp_path):
    """Regression's dry-run checks through build_plan: a target whose extent misses the scene, an all-nodata target,
    classes (an integer raster) given as a target, tree tops asked of a height with no minimum height, true tree
    tops that are polygons, empty or missing."""
    heights = np.linspace(0, 30, 512 * 512, dtype=np.float32).reshape(1, 512, 512)
    targets = {
        "far.tif": dict(data=heights, transform=rasterio.Affine(0.1, 0, 500000.0, 0, -0.1, 3285000.0)),
        "nodata.tif": dict(data=np.full_like(heights, -1.0), transform=TRANSFORM, nodata=-1.0),
        "classes.tif": dict(data=(heights > 10).astype(np.uint8), transform=TRANSFORM),
        "heights.tif": dict(data=heights, transform=TRANSFORM),
    }
    for name, kwargs in targets.items():
        write_raster(tmp_path / name, 512, 512, count=1, **kwargs)

    def config(target: str, **sections: dict) -> dict:
        scenes = {"train": {"path": str(data / "train.tif"), "annotations": str(tmp_path / target)}}
        return {
            "task": "regression",
            "scenes": scenes,
            "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
            "train": {"scenes": ["train"], "devices": 1, "validation_fraction": 0.3},
            **sections,
        }

    cases = [
        (
            config("far.tif"),
            InputError,
            rf"^{re.escape(str(tmp_path / 'far.tif'))}: target raster \(EPSG:32617\) does not overlap the scene ",
        ),
        (config("nodata.tif"), InputError, "nodata.tif: target raster holds no data over the scene .*train.tif"),
        (config("classes.tif"), InputError, "classes.tif: .*uint8; regression needs a float raster of values"),
        (
            config("heights.tif", merge={"tree_tops": {"slope": 0.2}}),
            ConfigError,
            "^config: merge.tree_tops: 'min_height' is a required property$",
        ),
    ]
    tops = {  # true tree tops (scenes.X.tree_tops): crowns drawn instead of tops, a top left empty, points
        "crowns.gpkg": [shapely.box(404001, 3284990, 404003, 3284992), shapely.Point(404005, 3284995)],
        "empty.gpkg": [shapely.Point(404001, 3284990), shapely.Point()],
        "tops.gpkg": [shapely.Point(404001, 3284990), shapely.Point(404005, 3284995)],
    }
    for name, geometries in tops.items():
        gpd.GeoDataFrame(geometry=geometries, crs="EPSG:32617").to_file(tmp_path / name)

    def with_tops(file: str) -> dict:
        raw = config("heights.tif", merge={"tree_tops": {"min_height": 2}})
        raw["scenes"]["train"]["tree_tops"] = str(tmp_path / file)
        return raw

    need = re.escape("tree tops need points (one per tree)")
    cases += [
        (
            with_tops("crowns.gpkg"),
            InputError,
            rf"crowns.gpkg: feature 1 is a Polygon \(1 of 2 features are no points\); {need}$",
        ),
        (with_tops("empty.gpkg"), InputError, rf"empty.gpkg: feature 2 has an empty geometry \(1 such\); {need} "),
        (with_tops("missing.gpkg"), InputError, r"missing.gpkg: tree tops not found \(scenes.train.tree_tops\)$"),
    ]
    for raw, error, pattern in cases:
        with pytest.raises(error) as raised:
            build_plan(raw, tmp_path / "run")
        assert re.search(pattern, str(raised.value)) and "\n" not in str(raised.value), str(raised.value)
    build_plan(with_tops("tops.gpkg"), tmp_path / "run")  # all well


PEER_RANKS = """
import sys
sys.path.insert(0, {scripts!r})
from rasterscale.settings import job_settings
from rasterscale.runtime.launch import start_local_ranks
ranks = start_local_ranks(job_settings({{"predict": {{"devices": 2, "shards": 1}}}}), "predict")  # rank 0 starts 1
import torch.distributed as dist
from rasterscale.errors import InputError
from rasterscale.runtime.ranks import current_rank, setup_rank_logging
rank = current_rank()
setup_rank_logging(rank, sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 1:
    raise InputError("https://host/scene.tif?sig=x: tile 7 could not be read; run the same command again")
dist.all_gather_object([None, None], rank)  # rank 0 waits here, as in prediction's final gather
"""


def test_a_rank_whose_peer_failed_ends_with_one_line(tmp_path):
    """Rank 1 fails with its one line while rank 0 waits in a collective (prediction's final gather; a training
    step's all-reduce breaks alike, and every rank's exception hook is the same): the job's log holds rank 1's line
    and rank 0's one-line ending, no traceback (the ranks' own logs keep theirs). Rank 0 started rank 1, as a local
    job does: its watch of rank 1 and its broken gather say the same line, once."""
    script = tmp_path / "ranks.py"
    script.write_text(PEER_RANKS.format(scripts=str(REPO / "scripts")))
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("LOCAL_RANK", "RANK")}
    result = subprocess.run([sys.executable, str(script), str(logs)], env=env, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and 'File "' not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "rasterscale:" in line]
    assert lines == [
        "rasterscale: rank 1: https://host/scene.tif?sig=***: tile 7 could not be read; run the same command "
        f"again (traceback in {logs / 'rank-1.log'})",
        "rasterscale: rank 0: ending: rank 1 failed (see its line above)",
    ], result.stderr
    assert "Traceback" in (logs / "rank-1.log").read_text()


def test_annotation_labels_match_model_labels_whatever_their_case(data, tmp_path, caplog):
    """DeepForest's CSVs say `Tree`, the default model.labels `[tree]`: the dry run passes, the boxes are class
    `tree` (the model's spelling, which the outputs keep), the mapping is logged once; labels of one name in two
    cases stop the dry run with one line; a label of no case of model.labels still does."""
    rows = "".join(f"train.tif,{20 + 30 * k},100,{40 + 30 * k},120,Tree\n" for k in range(5))
    (tmp_path / "tree.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\n" + rows)
    base = config_of(data)
    scenes = {**base["scenes"], "train": {**base["scenes"]["train"], "annotations": str(tmp_path / "tree.csv")}}
    plan = build_plan({**base, "scenes": scenes}, tmp_path / "run")
    assert plan.labels == ("tree",)
    raster = check_raster(data / "train.tif")
    assert read_annotations(tmp_path / "tree.csv", raster, ["tree"]).labels.tolist() == [0] * 5
    caplog.clear()  # the reads above may have logged tree.csv's mapping already (by the logger's level)
    logger = logging.getLogger("rasterscale.tasks.labels")  # its own handler: a rank's setup stops propagation
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="rasterscale.tasks.labels"):
            for _ in range(2):
                labels = label_indexes("a.csv", np.array(["TREE", "shrub", "TREE"]), ["tree", "shrub"])
                assert labels.tolist() == [0, 1, 0]
    finally:
        logger.removeHandler(caplog.handler)
    records = {id(r): r for r in caplog.records}.values()  # a record reaches the handler once or twice (propagation)
    assert [r.getMessage() for r in records] == [
        "a.csv: label(s) matched to model.labels regardless of case: TREE -> tree (outputs name them so)"
    ]
    assert label_indexes("b.csv", np.array(["Tree", "tree"]), ["Tree", "tree"]).tolist() == [0, 1]  # exact first
    with pytest.raises(InputError, match=r"^c.csv: label\(s\) Oak are not in model.labels \(tree\)$"):
        label_indexes("c.csv", np.array(["Tree", "Oak"]), ["tree"])
    with pytest.raises(ConfigError) as raised:
        build_plan({**base, "scenes": scenes, "model": {**base["model"], "labels": ["Tree", "tree"]}}, tmp_path)
    assert str(raised.value) == "config: key 'model.labels' names class 'Tree' twice (Tree, tree)"


FORMATS = ["boxes.gpkg", "crowns.gpkg", "crowns.geojson", "crowns.parquet", "boxes.csv", "boxes.xml", "coco.json"]
FORMATS += ["classes.tif", "heights.tif", "tops.gpkg"]


def write_every_format(data: Path, folder: Path) -> list[str]:
    """The annotation formats the tasks read, each of train.tif: box and crown polygons (GeoPackage, GeoJSON,
    GeoParquet), a DeepForest CSV, a Pascal VOC file, a COCO file, a class raster and a height raster."""
    x, y = 404002, 3284990
    crowns = [shapely.Point(x + 1 + 3 * k, y + 1).buffer(1) for k in range(5)]
    write_boxes(folder / "boxes.gpkg")
    frame = gpd.GeoDataFrame({"label": ["tree"] * 5}, geometry=crowns, crs="EPSG:32617")
    frame.to_file(folder / "crowns.gpkg")
    frame.to_file(folder / "crowns.geojson")
    frame.to_parquet(folder / "crowns.parquet")
    boxes = [(20 + 30 * k, 100, 40 + 30 * k, 120) for k in range(5)]
    rows = "".join(f"train.tif,{a},{b},{c},{d},Tree\n" for a, b, c, d in boxes)
    (folder / "boxes.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\n" + rows)
    objects = "".join(
        f"<object><name>Tree</name><bndbox><xmin>{a}</xmin><ymin>{b}</ymin><xmax>{c}</xmax><ymax>{d}</ymax>"
        "</bndbox></object>"
        for a, b, c, d in boxes
    )
    (folder / "boxes.xml").write_text(f"<annotation><filename>train.tif</filename>{objects}</annotation>")
    coco = {
        "images": [{"id": 1, "file_name": "train.tif", "width": 512, "height": 512}],
        "categories": [{"id": 1, "name": "Tree"}],
        "annotations": [
            {"id": k, "image_id": 1, "category_id": 1, "segmentation": [[a, b, c, b + 2, a + 5, d]]}
            for k, (a, b, c, d) in enumerate(boxes)
        ],
    }
    (folder / "coco.json").write_text(json.dumps(coco))
    ones = np.ones((1, 512, 512))
    write_raster(folder / "classes.tif", 512, 512, count=1, data=ones.astype(np.uint8), transform=TRANSFORM)
    write_raster(folder / "heights.tif", 512, 512, count=1, data=ones.astype(np.float32), transform=TRANSFORM)
    tops = [shapely.Point(x + 1 + 3 * k, y + 1) for k in range(5)]  # tree tops: the crowns' centres
    gpd.GeoDataFrame({"height": [12.0] * 5}, geometry=tops, crs="EPSG:32617").to_file(folder / "tops.gpkg")
    return FORMATS


BOX_FILES = {
    "boxes.csv": "a CSV of boxes in pixels \\(DeepForest's\\), no outlines and no CRS",
    "boxes.xml": "a Pascal VOC XML file of boxes in pixels, no outlines and no CRS",
}
OUTLINES = "crowns need outlines: a COCO JSON file \\(polygons or masks\\) or polygons in a vector file"
SEGMENTS = "segmentation needs polygons in a vector file with a CRS, or a class raster on the scene's grid"
DETECTS = "detection boxes come as polygons in a vector file \\(boxes or outlines\\), a DeepForest CSV or a Pascal"
REGRESSES = "regression needs a float raster of target values"
RASTER = "a raster, not a vector file"
COCO = "a COCO instances file \\(outlines in an image's pixels, no CRS\\)"
TOPS = "tree tops need points \\(one per tree\\)"
POINTS = "feature 1 is a Point \\(5 of 5 features are no polygons\\)"  # tops.gpkg's, to a task of polygons
# task -> (its labels, {file: the start of its one line after "<file>: "; a file not named passes})
EVERY_FORMAT = {
    "detection": (
        ["tree"],
        {
            "coco.json": f"{COCO}; {DETECTS}",
            "classes.tif": f"{RASTER}; {DETECTS}",
            "heights.tif": f"{RASTER}; {DETECTS}",
            "tops.gpkg": f"{POINTS}; detection boxes need polygons",
        },
    ),
    "instances": (
        ["tree"],
        {**{f: f"{k}; {OUTLINES}" for f, k in BOX_FILES.items()}, "classes.tif": f"{RASTER}; {OUTLINES}"}
        | {"heights.tif": f"{RASTER}; {OUTLINES}", "tops.gpkg": f"{POINTS}; crowns need polygons"},
    ),
    "segmentation": (
        ["background", "tree"],
        {**{f: f"{k}; {SEGMENTS}" for f, k in BOX_FILES.items()}, "coco.json": f"{COCO}; {SEGMENTS}"}
        | {
            "heights.tif": "class raster band 1 is float32, not integer class ids",
            "tops.gpkg": f"{POINTS}; {SEGMENTS}",
        },
    ),
    "regression": (
        ["height"],
        {f: REGRESSES for f in [*FORMATS[:7], "tops.gpkg"]}
        | {"classes.tif": "target raster is uint8; regression needs a float raster"},
    ),
    # regression's true tree tops (scenes.X.tree_tops), which its scoring reads: points in a CRS
    "tree tops": (
        ["height"],
        {f: f"feature 1 is a Polygon \\(5 of 5 features are no points\\); {TOPS}" for f in FORMATS[:2]}
        | {"crowns.geojson": f"feature 0 is a Polygon \\(5 of 5 features are no points\\); {TOPS}"}
        | {"crowns.parquet": f"row 0 is a Polygon \\(5 of 5 features are no points\\); {TOPS}"}
        | {f: f"{k}; {TOPS}" for f, k in BOX_FILES.items()}
        | {"coco.json": f"{COCO}; {TOPS}", "classes.tif": f"{RASTER}; {TOPS}", "heights.tif": f"{RASTER}; {TOPS}"},
    ),
}


def test_every_annotation_format_meets_every_task_in_one_line(data, tmp_path):
    """Every format any task reads, given to every task's ground-truth check (what the dry run runs), and as
    regression's true tree tops: read, or refused with one line naming the file, what it is and what the task needs
    (was: a traceback of instances given a DeepForest CSV; "no CRS" of segmentation given one; tree tops and
    segmentation given points or polygons of the other kind passed the dry run)."""
    files = write_every_format(data, tmp_path)
    raster = check_raster(data / "train.tif")
    scene = settings_of(validate_config(tree_tops_config(data, "tops.gpkg"))).scenes["train"]
    regression = task_spec("regression")
    outcomes = {}
    for task, (labels, refused) in EVERY_FORMAT.items():
        for name in files:
            path = str(tmp_path / name)
            try:
                if task == "tree tops":
                    regression.check_scene_keys(dataclasses.replace(scene, tree_tops=path), "scenes.train.{}".format)
                else:
                    task_spec(task).check_annotations(path, raster, labels, None, "train.tif")
            except InputError as err:
                outcomes[task, name] = str(err)
                assert name in refused and "\n" not in str(err), (task, str(err))
                assert re.match(f"{re.escape(path)}: {refused[name]}", str(err)), (task, str(err))
            else:
                assert name not in refused, (task, name)
    assert len(outcomes) == sum(len(refused) for _, refused in EVERY_FORMAT.values())


def test_crowns_that_are_all_rectangles_warn_at_the_dry_run(data, tmp_path):
    """Crown polygons that are (nearly) all axis-aligned rectangles are a box file given by mistake: one warning
    line at the dry run (a real one: its wiring), which scenes.X.rectangles_ok silences; outlines, or fewer than
    9 in 10 rectangles, pass quietly; the key is instances' only."""
    result = dry_run(tmp_path / "run", crowns_config(data, "train.gpkg"))
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert [line for line in said if not line.startswith("rasterscale: plan: ")] == [  # but the cost estimate
        f"rasterscale: warning: {data / 'train.gpkg'}: 5 of 5 polygons are axis-aligned rectangles: boxes, not "
        "crowns' outlines? Mask R-CNN would learn rectangular crowns; give outlines (a COCO JSON file or polygons), "
        "or set scenes.train.rectangles_ok: true if they are meant"
    ]
    x, y = 404002, 3284990
    tilted = shapely.affinity.rotate(shapely.box(x, y - 9, x + 2, y - 7), 30)
    for rectangles, outlines, warned in [(9, 1, True), (8, 2, False), (0, 3, False)]:
        boxes = [shapely.box(x + 3 * k, y, x + 2 + 3 * k, y + 2) for k in range(rectangles)]
        crowns = [shapely.Point(x + 1 + 3 * k, y - 3).buffer(1) for k in range(outlines - 1)]
        write_crowns(tmp_path / "mixed.gpkg", [*boxes, *crowns, tilted])  # a rotated box is an outline
        config = crowns_config(data, "train.gpkg")
        config["scenes"]["train"]["annotations"] = str(tmp_path / "mixed.gpkg")
        for silenced in (False, True):
            config["scenes"]["train"]["rectangles_ok"] = silenced
            lines: list[str] = []
            build_plan(config, tmp_path / "run", warn=lines.append)
            assert len(lines) == (warned and not silenced), (rectangles, lines)
            assert all(f"{rectangles} of {rectangles + outlines} polygons are axis-aligned" in line for line in lines)
    detection = config_of(data)
    detection["scenes"]["train"]["rectangles_ok"] = True
    with pytest.raises(ConfigError) as raised:
        build_plan(detection, tmp_path / "run")
    assert (
        str(raised.value)
        == "config: key 'scenes.train.rectangles_ok' applies to task instances only, and task is detection"
    )


def test_a_failure_marker_counts_for_its_own_launch_only(tmp_path, monkeypatch):
    """A marker that a failed run left in the log folder is not this run's (another rendezvous port), and a rank
    that starts again removes its own."""
    from rasterscale.runtime import peers

    monkeypatch.setattr(peers, "_folder", None)
    monkeypatch.setenv("MASTER_PORT", "29500")
    peers.start(tmp_path, 0)
    peers.mark_failed(2, "the last run's")
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert peers.failed_peers(0) == []
    peers.mark_failed(1, "this run's")
    assert peers.failed_peers(0) == [1] and peers.failed_peers(1) == []
    peers.start(tmp_path, 1)
    assert peers.failed_peers(0) == []
    assert peers.ending_line(0, [1, 3]) == "rasterscale: rank 0: ending: ranks 1, 3 failed (see their lines above)"
