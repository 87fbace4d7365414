import numpy as np
import pytest
import rasterio
import shapely
from affine import Affine

from rasterscale.errors import InputError
from rasterscale.grid.manifest import build_manifest, read_grid, tile_grid, tile_offsets, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.raster.imagery import read_spec, resolve_spec


@pytest.mark.parametrize(
    ("length", "patch", "overlap"),
    [(1000, 400, 80), (400, 400, 80), (401, 400, 80), (4096, 400, 80), (1234, 256, 0), (999, 100, 99)],
)
def test_offsets_cover_axis_with_overlap_and_flush_last_tile(length, patch, overlap):
    offsets = tile_offsets(length, patch, overlap)
    assert offsets[0] == 0
    assert offsets[-1] + patch == length  # last tile flush with the edge
    steps = np.diff(offsets)
    assert (steps <= patch - overlap).all()  # neighbours overlap at least `overlap`
    assert (steps > 0).all()
    covered = np.zeros(length, dtype=bool)
    for start in offsets:
        covered[start : start + patch] = True
    assert covered.all()


def test_raster_smaller_than_patch_gives_one_tile_of_raster_size():
    grid = tile_grid(150, 90, 400, 80)
    assert grid.tolist() == [[0, 0, 150, 90]]


def test_overlap_must_be_smaller_than_patch():
    with pytest.raises(ValueError, match="overlap"):
        tile_offsets(1000, 100, 100)


def test_grid_is_row_major_and_inside_raster():
    grid = tile_grid(1000, 700, 400, 80)
    cols, rows = tile_offsets(1000, 400, 80), tile_offsets(700, 400, 80)
    assert len(grid) == len(cols) * len(rows)
    assert grid[: len(cols), 1].tolist() == [0] * len(cols)
    assert (grid[:, 0] + grid[:, 2] <= 1000).all() and (grid[:, 1] + grid[:, 3] <= 700).all()


def test_manifest_footprints_are_in_the_raster_crs(raster_factory):
    transform = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
    path = raster_factory(width=1000, height=700, transform=transform)
    manifest = build_manifest(path, 400, 80)
    assert list(manifest.columns) == ["tile_id", "col_off", "row_off", "width", "height", "geometry"]
    assert manifest.crs.to_epsg() == 32617
    assert manifest["tile_id"].tolist() == list(range(len(manifest)))
    first = manifest.iloc[0].geometry
    assert first.bounds == pytest.approx((404000.0, 3285000.0 - 40.0, 404040.0, 3285000.0))
    # the union of footprints is exactly the raster's footprint
    with rasterio.open(path) as src:
        bounds = src.bounds
    assert shapely.union_all(manifest.geometry.values).equals(shapely.box(*bounds))
    last = manifest.iloc[-1]
    assert last.col_off + last.width == 1000 and last.row_off + last.height == 700


def test_manifest_of_rotated_raster_uses_transformed_corners(raster_factory):
    transform = Affine.translation(500000, 4000000) @ Affine.rotation(30) @ Affine.scale(0.5, -0.5)
    path = raster_factory(width=300, height=300, transform=transform)
    manifest = build_manifest(path, 300, 0)
    corners = np.array(manifest.iloc[0].geometry.exterior.coords)[:4]
    expected = [transform @ (0, 0), transform @ (300, 0), transform @ (300, 300), transform @ (0, 300)]
    assert corners == pytest.approx(np.array(expected))


def test_all_nodata_tiles_are_skipped_only_when_asked(raster_factory):
    data = np.zeros((3, 800, 800), dtype=np.uint8)
    data[:, 420:, 420:] = 200  # valid pixels only in the lower-right quarter
    path = raster_factory(width=800, height=800, data=data, nodata=0)
    full = build_manifest(path, 200, 0, skip_nodata=False)
    kept = build_manifest(path, 200, 0, skip_nodata=True)
    assert len(full) == 16
    # tiles whose window touches valid pixels (cols/rows >= 400) survive; the top-left 3x3 block... is dropped
    survivors = set(zip(kept.col_off, kept.row_off, strict=True))
    assert (600, 600) in survivors and (0, 0) not in survivors
    assert all(c >= 400 and r >= 400 for c, r in survivors) or len(kept) <= 9
    assert len(kept) < len(full)


def test_manifest_reads_no_pixels_without_nodata(raster_factory, monkeypatch):
    path = raster_factory(width=500, height=500)

    def forbid(*args, **kwargs):
        raise AssertionError("pixels were read")

    monkeypatch.setattr(rasterio.io.DatasetReader, "read", forbid)
    monkeypatch.setattr(rasterio.io.DatasetReader, "dataset_mask", forbid)
    assert len(build_manifest(path, 200, 20)) == 9


def test_the_manifest_carries_its_tile_grid_and_an_old_manifest_fails_in_one_line(raster_factory, tmp_path):
    """Patch size and overlap travel with the manifest (the segmentation blend takes its taper from there, not from
    the config); a manifest without them fails with one line naming the file and the fix."""
    path = raster_factory(width=500, height=300)
    manifest = build_manifest(path, 200, 40)
    out = tmp_path / "tiles.parquet"
    write_manifest(manifest, resolve_spec(path), TileGrid(200, 40), out)
    assert read_grid(out) == TileGrid(200, 40)
    assert read_spec(out) == resolve_spec(path)
    old = tmp_path / "old.parquet"
    manifest.to_parquet(old)
    with pytest.raises(InputError, match=rf"^{old}: tile manifest holds no tile grid .*; delete it and run again$"):
        read_grid(old)
