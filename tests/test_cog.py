"""A striped input raster is read from a tiled COG that the workflow makes (rule convert_to_cog)."""

import json

import geopandas as gpd
import numpy as np
import pytest
import rasterio
from rio_cogeo.cogeo import cog_validate

from conftest import write_raster
from prediction import PredictScene
from rasterscale.jobs.paths import RunPaths
from rasterscale.raster.cog import convert_to_cog
from rasterscale.raster.headers import check_raster
from workflow import run_workflow

RUN = "results/model"  # the run of PredictScene's model.pt, given as model.file without model.name: the file's stem


@pytest.fixture
def striped(tmp_path):
    path = write_raster(tmp_path / "striped.tif", 500, 300, nodata=0, tiled=False)
    assert not check_raster(path).is_tiled
    return path


def striped_config(raster, model):
    return {
        "scenes": {"striped": {"path": str(raster)}},
        "model": {"backbone": "resnet18", "file": str(model)},
        "tiling": {"patch_size": PredictScene.patch_size, "overlap": PredictScene.overlap},
        "predict": {"scenes": ["striped"], "devices": 1, "workers": 0, "batch_size": 4},
    }


def test_conversion_keeps_pixels_and_georeferencing_in_a_tiled_cog(tmp_path):
    striped = write_raster(tmp_path / "large.tif", 1100, 700, nodata=0, tiled=False)
    cog = tmp_path / "cog.tif"
    convert_to_cog(striped, cog)
    assert check_raster(cog).is_tiled
    assert cog_validate(str(cog))[0]
    with rasterio.open(striped) as src, rasterio.open(cog) as dst:
        assert np.array_equal(src.read(), dst.read())
        assert (dst.crs, dst.transform, dst.nodata, dst.count) == (src.crs, src.transform, src.nodata, src.count)
        assert dst.block_shapes[0] == (512, 512) and dst.overviews(1)


def test_dry_run_warns_and_plans_the_conversion(striped, tmp_path):
    scene = PredictScene.make(tmp_path / "model")
    result = run_workflow(tmp_path / "run", striped_config(striped, scene.model_file), "-n")
    assert "convert_to_cog" in result.stdout
    assert f"warning: {striped} is striped, not tiled" in result.stderr
    assert f"{RUN}/striped/cog.tif (rule convert_to_cog)" in result.stderr


def test_tiled_input_is_read_as_it_is(tmp_path):
    scene = PredictScene.make(tmp_path / "model")
    result = run_workflow(tmp_path / "run", striped_config(scene.raster, scene.model_file), "-n")
    assert "convert_to_cog" not in result.stdout and "striped" not in result.stderr


@pytest.mark.slow
def test_striped_scene_is_predicted_from_its_cog(striped, tmp_path):
    scene = PredictScene.make(tmp_path / "model")
    workdir = tmp_path / "run"
    merged = RunPaths("model").batch_record("merged", 0)  # up to the merged layers: no quicklook or report pages
    run_workflow(workdir, striped_config(striped, scene.model_file), merged)
    cog = workdir / RUN / "striped/cog.tif"
    assert check_raster(cog).is_tiled
    manifest = gpd.read_parquet(workdir / RUN / "striped/tiles.parquet")
    profile = json.loads((workdir / RUN / "striped/predict_profile.json").read_text())
    assert profile["total"]["tiles"] == len(manifest) > 0
    assert f"{RUN}/striped/cog.tif: 500x300 px" in (workdir / "logs/convert_to_cog/striped.log").read_text()
    assert gpd.read_parquet(workdir / RUN / "striped/detections.parquet").crs == check_raster(striped).crs
