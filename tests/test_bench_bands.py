"""make bench's many-bands section (bench/many_bands.py) on tiny sizes: the real segmenter reading and predicting
at 3, 4 and 13 bands, and the 13-band raster read pixel- and band-interleaved; the figures and the rows they make.
No timing is asserted (the CPU is shared): what the FLOP counter says is."""

from __future__ import annotations

import sys

import pytest
import rasterio

from conftest import REPO

sys.path.append(str(REPO / "bench"))  # the bench's modules import each other by name, as bench/run.py runs them

from many_bands import FOUR_OF_13, measure_band_throughput, measure_interleave, write_bands_raster
from rasterscale.raster.imagery import resolve_spec
from suite import TARGETS, bands_figures, bands_rows


@pytest.mark.parametrize("interleave", ["pixel", "band"])
def test_the_raster_is_written_in_its_interleave_and_the_read_bands_are_the_asked_ones(tmp_path, interleave):
    path = write_bands_raster(tmp_path / "s2.tif", 300, 13, "uint16", interleave)
    with rasterio.open(path) as src:
        assert src.count == 13 and src.dtypes[0] == "uint16" and src.interleaving.name.lower() == interleave
        assert src.block_shapes[0] == (256, 256) and src.compression.name.lower() == "deflate"
        assert len({int(src.read(b, window=((0, 8), (0, 8))).mean()) for b in FOUR_OF_13}) == len(FOUR_OF_13)


def test_a_4_band_uint8_raster_has_no_alpha_band(tmp_path):
    path = write_bands_raster(tmp_path / "rgbn.tif", 300, 4, "uint8")
    assert resolve_spec(path, [1, 2, 3, 4]).mask == "none"  # the 4th band is read as a band, not as a mask


@pytest.mark.slow
def test_many_bands_measures_and_renders_its_rows(tmp_path):
    throughput = measure_band_throughput(tmp_path / "bands", tiles=1, batch_size=4, rounds=1)
    bands = throughput["bands"]
    assert list(bands) == ["3", "4", "13"] and bands["3"]["throughput_vs_3"] == 1.0
    assert [bands[c]["dtype"] for c in bands] == ["uint8 scaled", "uint8 scaled", "float32 raw"]
    assert bands["13"]["names"][:4] == ["B01", "B02", "B03", "B04"]
    rest = {c: round(b["gflop_per_tile"] - b["first_conv_gflop_per_tile"], 1) for c, b in bands.items()}
    assert len(set(rest.values())) == 1, rest  # more bands: more FLOPs in the first convolution only
    assert bands["13"]["first_conv_gflop_per_tile"] / bands["3"]["first_conv_gflop_per_tile"] == pytest.approx(
        13 / 3, rel=0.01
    )
    for run in bands.values():
        assert run["tiles_per_s"] > 0 and min(run[f"{p}_s_per_tile"] for p in ("read", "first_conv", "rest")) > 0
    interleave = measure_interleave(tmp_path / "interleave", side=720, rounds=1)
    assert interleave["tiles"] == 4 and interleave["four"]["bands"] == list(FOUR_OF_13)
    assert not list((tmp_path / "interleave").glob("*.tif"))  # removed once read
    result = {"details": {"bands": {"throughput": throughput, "interleave": interleave}}}
    figures = bands_figures(result["details"]["bands"])
    assert set(figures) <= set(TARGETS)
    rows = bands_rows({**result, **figures})
    assert [row[0] for row in rows] == [
        "throughput 4 / 3 bands",
        "throughput 13 / 3 bands",
        "rest of the network 13 / 3 bands",
        "read 4 of 13 bands, band / pixel interleave",
        "read 13 of 13 bands, band / pixel interleave",
    ]
    assert "720^2 uint16 raster (4 tiles of 400 px, all bands raw)" in rows[-1][3]
