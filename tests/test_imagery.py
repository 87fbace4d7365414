"""Imagery as it comes: RGBA orthomosaics, 16-bit with a declared or percentile scale, band selection; on real
rasters written with rasterio, through the manifest and the readers that training and prediction use."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import rasterio
import torch

from conftest import REPO, write_raster, write_rgba
from rasterscale.datasets.tiles import WindowDataset, load_region, prediction_dataset
from rasterscale.errors import InputError
from rasterscale.grid.manifest import build_manifest, tiles_from_frame, write_manifest
from rasterscale.grid.tile import Tile, TileGrid
from rasterscale.raster.imagery import SPEC_KEY, ImageSpec, on_data, read_spec, resolve_spec, valid_at
from rasterscale.tasks.detection.dataset import TrainTileDataset
from rasterscale.tasks.detectors.merge import drop_masked


def rgba_with_masked_corner(size: int = 512, corner: int = 300) -> np.ndarray:
    """Bright RGB everywhere; the top-left ``corner`` square has alpha 0 (and RGB 255, as some tools write)."""
    data = np.full((4, size, size), 120, dtype=np.uint8)
    data[3] = 255
    data[:3, :corner, :corner] = 255
    data[3, :corner, :corner] = 0
    return data


def manifest_of(path, tmp_path, patch=128, overlap=0, **imagery):
    spec = resolve_spec(path, imagery.get("bands"), imagery.get("scale"), "scenes.x")
    out = tmp_path / "tiles.parquet"
    write_manifest(build_manifest(path, patch, overlap, True, spec), spec, TileGrid(patch, overlap), out)
    return out


def test_rgba_manifest_skips_wholly_masked_tiles_and_readers_fill_masked_pixels(tmp_path):
    path = write_rgba(tmp_path / "ortho.tif", rgba_with_masked_corner())
    manifest = manifest_of(path, tmp_path)
    spec = read_spec(manifest)
    assert (spec.mask, spec.alpha, spec.bands) == ("alpha", 4, (1, 2, 3))
    tiles = tiles_from_frame(pq.read_table(manifest).to_pandas())
    # 4x4 tiles of 128 px; the masked 300 px corner holds the 2x2 top-left tiles wholly
    kept = {(t.col_off, t.row_off) for t in tiles}
    assert len(tiles) == 12 and not kept & {(0, 0), (128, 0), (0, 128), (128, 128)}
    edge = next(t for t in tiles if (t.col_off, t.row_off) == (256, 256))  # the corner's last 44 px
    pixels = WindowDataset(path, [edge], spec)[0][0].numpy()
    assert pixels.dtype == np.uint8 and pixels.shape == (3, 128, 128)
    assert (pixels[:, :44, :44] == spec.fill).all() and (pixels[:, 44:, :] == 120).all()
    region = load_region(path, rasterio.windows.Window(0, 0, 512, 512), spec)
    assert (region[:, :300, :300] == 0).all() and (region[:, 300:] == 120).all()


def test_training_and_prediction_read_the_same_filled_pixels(tmp_path):
    path = write_rgba(tmp_path / "ortho.tif", rgba_with_masked_corner())
    spec = read_spec(manifest_of(path, tmp_path))
    tile = Tile(0, 200, 200, 128, 128)
    trained = TrainTileDataset(path, [tile], spec, np.zeros((0, 4)), np.zeros(0))[0][0]
    for strategy in ("window", "single", "batch"):
        predicted = prediction_dataset(strategy, path, [tile], spec)[0][0]
        assert predicted.dtype == torch.uint8
        assert torch.equal(predicted.float() / 255, trained)


def test_16_bit_declared_scale_lands_values_where_expected(tmp_path):
    data = np.zeros((4, 256, 256), dtype=np.uint16)
    data[0], data[1], data[2], data[3] = 1000, 3000, 2000, 60000  # band 4 (NIR, say) is beyond the scale
    data[0, :, :10] = 500  # below min: clipped to 0
    path = write_raster(tmp_path / "ms16.tif", 256, 256, count=4, data=data)
    scale = {"min": [1000, 1000, 1000], "max": [3000, 5000, 2000]}
    manifest = manifest_of(path, tmp_path, scale=scale)
    spec = read_spec(manifest)
    assert (spec.scale, spec.low, spec.high, spec.mask) == ("declared", (1000,) * 3, (3000, 5000, 2000), "none")
    metadata = json.loads(pq.read_schema(manifest).metadata[SPEC_KEY])
    assert metadata["low"] == [1000, 1000, 1000] and metadata["bands"] == [1, 2, 3]
    pixels = WindowDataset(path, [Tile(0, 0, 0, 64, 64)], spec)[0][0].numpy()
    assert pixels.dtype == np.uint8
    assert (pixels[0, :, :10] == 0).all() and (pixels[0, :, 10:] == 0).all()  # 500 and 1000 -> 0
    assert (pixels[1] == 128).all()  # 3000 in [1000, 5000] -> 127.5 -> 128
    assert (pixels[2] == 255).all()  # 2000 at max


def test_16_bit_percentile_stretch_is_computed_once_and_stored(tmp_path):
    ramp = np.tile(np.arange(1000, dtype=np.uint16) * 10, (3, 1000, 1))  # every band 0..9990 along x
    path = write_raster(tmp_path / "ramp16.tif", 1000, 1000, data=ramp)
    spec = read_spec(manifest_of(path, tmp_path, scale={"percentile": [2, 98]}))
    assert spec.scale == "percentile 2-98"
    assert spec.low == pytest.approx((200,) * 3, abs=20) and spec.high == pytest.approx((9790,) * 3, abs=20)
    pixels = WindowDataset(path, [Tile(0, 0, 0, 1000, 8)], spec)[0][0].numpy()
    assert (pixels[:, :, :20] == 0).all() and (pixels[:, :, 980:] == 255).all()  # beyond the percentiles: clipped
    middle = pixels[0, 0, 500]  # 5000 -> (5000 - 200) / 9590 * 255
    assert abs(int(middle) - round((5000 - spec.low[0]) / (spec.high[0] - spec.low[0]) * 255)) <= 1


def test_percentile_stretch_ignores_masked_pixels(tmp_path):
    data = np.full((4, 256, 256), 2000, dtype=np.uint16)
    data[:3, 100:, :] = np.arange(256, dtype=np.uint16) * 10 + 2000
    data[:3, :100] = 65535  # masked: must not move the stretch
    data[3] = 65535
    data[3, :100] = 0
    path = write_rgba(tmp_path / "rgba16.tif", data)
    spec = resolve_spec(path, None, {"percentile": [0, 100]}, "scenes.x")
    assert spec.mask == "alpha" and spec.high[0] == pytest.approx(2000 + 2550)


def test_band_selection_of_a_four_band_raster(tmp_path):
    data = np.stack([np.full((128, 128), v, dtype=np.uint8) for v in (10, 20, 30, 255)])
    data[3, :, :64] = 0
    path = write_rgba(tmp_path / "four.tif", data)
    spec = read_spec(manifest_of(path, tmp_path, patch=64, bands=[3, 2, 1]))
    assert (spec.bands, spec.mask) == ((3, 2, 1), "alpha")
    pixels = WindowDataset(path, [Tile(0, 0, 0, 128, 128)], spec)[0][0].numpy()
    assert [int(pixels[k, 0, 100]) for k in range(3)] == [30, 20, 10] and (pixels[:, :, :64] == 0).all()


def test_any_three_bands_of_a_multispectral_raster(tmp_path):
    data = np.stack([np.full((64, 64), v, dtype=np.uint8) for v in (10, 20, 30, 40, 50)])
    path = write_raster(tmp_path / "five.tif", 64, 64, count=5, data=data)
    spec = resolve_spec(path, [5, 1, 2], None, "scenes.x")
    assert spec.mask == "none"
    assert [int(v[0, 0]) for v in WindowDataset(path, [Tile(0, 0, 0, 8, 8)], spec)[0][0].numpy()] == [50, 10, 20]


def test_nodata_value_marks_pixels_missing_in_all_three_bands(tmp_path):
    data = np.full((3, 128, 128), 7, dtype=np.uint8)
    data[:, :10] = 255
    data[0, 10:20] = 255  # one band at the nodata value: a valid (red) pixel
    path = write_raster(tmp_path / "nd.tif", 128, 128, data=data, nodata=255)
    spec = resolve_spec(path)
    assert (spec.mask, spec.nodata) == ("nodata", 255)
    pixels = WindowDataset(path, [Tile(0, 0, 0, 128, 128)], spec)[0][0].numpy()
    assert (pixels[:, :10] == 0).all() and (pixels[0, 10:20] == 255).all() and (pixels[1, 10:] == 7).all()


def test_detections_centred_on_masked_pixels_are_dropped(tmp_path):
    path = write_rgba(tmp_path / "ortho.tif", rgba_with_masked_corner(size=2100, corner=1100))
    spec = resolve_spec(path)
    boxes = pd.DataFrame(
        [[0, 0, 10, 10], [1095, 1095, 1109, 1109], [1095, 1095, 1101, 1101], [2000, 10, 2050, 40], [5, 1094, 20, 1104]],
        columns=["px_xmin", "px_ymin", "px_xmax", "px_ymax"],
    )  # centres (the corner is [0, 1100) squared): masked, valid, masked, valid, masked (row 1099)
    assert drop_masked(boxes, path, spec).index.tolist() == [1, 3]
    assert valid_at(path, spec, np.array([1100.0, -1.0, 2100.0]), np.array([1100.0, 5.0, 5.0])).tolist() == [
        True,
        False,
        False,
    ]
    assert len(drop_masked(boxes, path, ImageSpec())) == 5  # no mask: nothing to drop
    assert on_data(path, spec, boxes.to_numpy()).tolist() == [False, True, False, True, False]


def test_spec_round_trips_through_json():
    spec = ImageSpec((3, 2, 1), "alpha", 4, None, (1.0, 2.0, 3.0), (4.0, 5.0, 6.0), "percentile 2-98")
    assert ImageSpec.from_json(spec.to_json()) == spec
    assert "percentile 2-98" in spec.describe() and "band 4" in spec.describe()


def test_manifest_without_spec_says_how_to_fix(tmp_path, raster_factory):
    path = tmp_path / "old.parquet"
    build_manifest(raster_factory(width=64, height=64), 32, 0).to_parquet(path)
    with pytest.raises(InputError, match=r"old.parquet: tile manifest holds no imagery spec .*rerun rule tiles"):
        read_spec(path)


def test_tile_manifest_entry_logs_the_spec(tmp_path):
    ramp = np.tile(np.arange(256, dtype=np.uint16) * 100, (3, 256, 1))
    path = write_raster(tmp_path / "ramp.tif", 256, 256, data=ramp)
    from rasterscale.jobs.files import TilesJob
    from rasterscale.scene import Imagery, Scene
    from rasterscale.settings import job_settings

    imagery = Imagery("scenes.ramp", [1, 2, 3], {"percentile": [1, 99]})
    out = tmp_path / "tiles.parquet"
    tiling = job_settings({"tiling": {"patch_size": 128, "overlap": 0, "skip_nodata": True}})
    TilesJob((Scene("ramp", str(path), str(out), imagery),), tiling).write(tmp_path / "job.json")
    command = [sys.executable, str(REPO / "scripts/tiles.py"), "--job", str(tmp_path / "job.json")]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "imagery bands [1, 2, 3], mask none, scale percentile 1-99: [" in result.stdout
    assert read_spec(out).scale == "percentile 1-99"
