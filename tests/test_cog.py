"""A striped input raster is read from a tiled COG that the workflow makes (rule cog)."""

import json
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
from rio_cogeo.cogeo import cog_validate

from conftest import write_raster
from prediction import PredictScene
from rasterscale.jobs.paths import RunPaths
from rasterscale.raster.cog import cog_of_scratch, convert_to_cog, scratch_profile
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


def scratch_raster(path: Path, dtype: str, count: int, nodata: float | None, masked: bool) -> Path:
    """A merge's scratch raster (:func:`scratch_profile`) of ``count`` bands of ``dtype``: a few values, and
    with ``masked`` an internal mask over a hole, where every band holds 0 (as a merge writes its probabilities)."""
    width, height = 1100, 700
    rng = np.random.default_rng(4)
    data = rng.integers(0, 4, size=(count, height, width)).astype(dtype) * (60 if dtype == "uint8" else 0.37)
    hole = np.zeros((height, width), dtype=bool)
    hole[100:400, 200:700] = masked
    data[:, hole] = 0
    profile = {"width": width, "height": height, "count": count, "dtype": dtype, "nodata": nodata}
    profile.update(crs="EPSG:32617", transform=rasterio.Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0))
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True), rasterio.open(path, "w", **scratch_profile(profile)) as dst:
        dst.write(data)
        dst.update_tags(labels='["a", "b"]')
        if masked:
            dst.write_mask(np.where(hole, 0, 255).astype(np.uint8))
    return path


@pytest.mark.parametrize(
    ("dtype", "count", "nodata", "masked", "resampling"),
    [("uint8", 1, 255, False, "mode"), ("uint8", 3, None, True, "average"), ("float32", 1, -9999.0, False, "average")],
)
def test_a_merges_scratch_raster_becomes_the_cog_rio_cogeo_makes_of_it(
    tmp_path, dtype, count, nodata, masked, resampling
):
    """What a merge writes (classes, probabilities with a mask, values): its uncompressed scratch raster made a COG
    by cog_of_scratch, on 1 or 2 threads, is byte for byte what rio_cogeo's conversion makes of the same raster."""
    scratch = scratch_raster(tmp_path / "scratch.tif", dtype, count, nodata, masked)
    reference = tmp_path / "reference.tif"
    convert_to_cog(scratch, reference, overview_resampling=resampling, add_mask=masked)
    for threads in (1, 2):
        copy = tmp_path / f"copy-{threads}.tif"
        copy.write_bytes(scratch.read_bytes())
        cog_of_scratch(copy, tmp_path / f"cog-{threads}.tif", overview_resampling=resampling, threads=threads)
        assert (tmp_path / f"cog-{threads}.tif").read_bytes() == reference.read_bytes()
    assert cog_validate(str(reference))[0]


def test_the_mask_of_a_two_band_scratch_raster_is_the_cogs(tmp_path):
    """A two-class segmentation's probabilities keep their mask in the COG and its overviews (rio_cogeo's conversion
    of two bands and a mask wrote every pixel as valid)."""
    scratch = scratch_raster(tmp_path / "scratch.tif", "uint8", 2, None, masked=True)
    with rasterio.open(scratch) as src:
        mask = src.dataset_mask()
    cog = tmp_path / "cog.tif"
    cog_of_scratch(scratch, cog, overview_resampling="average")
    with rasterio.open(cog) as dst:
        assert np.array_equal(dst.dataset_mask(), mask)
        overview = dst.dataset_mask(out_shape=(mask.shape[0] // 2, mask.shape[1] // 2))
    assert (overview == 0).sum() == (mask == 0).sum() // 4
    assert cog_validate(str(cog))[0]


def test_dry_run_warns_and_plans_the_conversion(striped, tmp_path):
    scene = PredictScene.make(tmp_path / "model")
    result = run_workflow(tmp_path / "run", striped_config(striped, scene.model_file), "-n")
    assert "rule cog:" in result.stdout
    assert f"warning: {striped} is striped, not tiled" in result.stderr
    assert f"{RUN}/striped/cog.tif (rule cog)" in result.stderr


def test_tiled_input_is_read_as_it_is(tmp_path):
    scene = PredictScene.make(tmp_path / "model")
    result = run_workflow(tmp_path / "run", striped_config(scene.raster, scene.model_file), "-n")
    assert "rule cog:" not in result.stdout and "striped" not in result.stderr


@pytest.mark.slow
def test_striped_scene_is_predicted_from_its_cog(striped, tmp_path):
    scene = PredictScene.make(tmp_path / "model")
    workdir = tmp_path / "run"
    merged = RunPaths("model").batch_record("merge", 0)  # up to the merged layers: no quicklook or report pages
    run_workflow(workdir, striped_config(striped, scene.model_file), merged)
    cog = workdir / RUN / "striped/cog.tif"
    assert check_raster(cog).is_tiled
    manifest = gpd.read_parquet(workdir / RUN / "striped/tiles.parquet")
    profile = json.loads((workdir / RUN / "striped/predict_profile.json").read_text())
    assert profile["total"]["tiles"] == len(manifest) > 0
    assert f"{RUN}/striped/cog.tif: 500x300 px" in (workdir / "logs/cog/striped.log").read_text()
    assert gpd.read_parquet(workdir / RUN / "striped/detections.parquet").crs == check_raster(striped).crs
