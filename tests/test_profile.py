"""The per-rank prediction profile: what a rank stores, what the merge gathers and prints."""

import datetime
import json
import math

import pytest

from conftest import report
from prediction import PredictScene, predict_rank_file
from rasterscale.jobs.profile import STAGES, RankProfile, format_profile_table, summarize, write_scene_profile
from rasterscale.jobs.rankfiles import read_rank_record, write_rank_record
from rasterscale.runtime.precision import choose, probe

FIELDS = set(RankProfile.__dataclass_fields__)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    directory = tmp_path_factory.mktemp("profile")
    scene = PredictScene.make(directory)
    path = predict_rank_file(scene, directory / "predict", batch_size=5, workers=1)
    return scene, path


def rank(index, tiles, wall, wait, **extra):
    return {
        "rank": index,
        "tiles": tiles,
        "batches": math.ceil(tiles / 4),
        "wall_s": wall,
        "wait_s": wait,
        "tiles_per_s": tiles / wall,
        "batches_per_s": math.ceil(tiles / 4) / wall,
        "memory_peak_mb": 900.0 + index,
        "host_rss_peak_mb": 1000.0 + index,
        "memory_kind": "host_rss",
        "utilization_source": "cpu_time",
        **extra,
    }


@pytest.mark.slow
def test_rank_file_holds_the_rank_profile(profiled):
    scene, path = profiled
    profile = read_rank_record(path.with_suffix(""))["profile"]
    assert set(profile) == FIELDS
    assert profile["rank"] == 0 and profile["world_size"] == 1 and profile["device"] == "cpu"
    assert profile["strategy"] == "window" and profile["workers"] == 1 and profile["batch_size"] == 5
    # predict.precision auto, resolved on this CPU: what the profile records is what the rank ran at
    assert profile["precision"] == choose(probe("cpu"))
    assert profile["tiles"] == scene.tiles and profile["batches"] == math.ceil(scene.tiles / 5)
    # the wall splits exactly into compute, the rank output taking the boxes, and waiting for data
    assert profile["wall_s"] > 0 and 0 < profile["compute_s"] <= profile["wall_s"]
    assert 0 < profile["output_s"] < profile["compute_s"] and profile["wait_s"] > 0
    parts = profile["compute_s"] + profile["output_s"] + profile["wait_s"]
    assert parts == pytest.approx(profile["wall_s"], abs=1e-3)
    output_fraction = profile["output_s"] / profile["wall_s"]  # of rounded figures
    assert profile["output_fraction"] == pytest.approx(output_fraction, abs=1e-4 / profile["wall_s"] + 1e-4)
    assert profile["tiles_per_s"] == pytest.approx(scene.tiles / profile["wall_s"], rel=1e-3)
    assert profile["batches_per_s"] == pytest.approx(profile["batches"] / profile["wall_s"], rel=1e-3)
    # CPU: device memory is the rank's resident set, utilization its CPU time share
    assert profile["memory_kind"] == "host_rss" and profile["utilization_source"] == "cpu_time"
    assert 100 < profile["memory_mean_mb"] <= profile["memory_peak_mb"] <= profile["host_rss_peak_mb"] + 1
    assert profile["memory_peak_mb"] < profile["memory_total_mb"]
    assert 0 < profile["utilization"] <= 1.5 and profile["threads"] >= 1
    assert profile["workers_rss_peak_mb"] > 0  # its one dataloader worker was seen


@pytest.mark.slow
def test_the_stage_timeline_adds_up_to_the_rank_wall_its_log_measured(profiled):
    """The rank's stages (its main thread's time, lap by lap) add up to its wall, and that wall is within 5% of the
    time its log says it spent between starting to predict and writing its output (the output's final write, a
    GeoParquet of a few boxes, being the difference); its worker's reads and its CPU device's stages are measured."""
    _, path = profiled
    profile = read_rank_record(path.with_suffix(""))["profile"]
    stages, parallel = profile["stages"], profile["parallel"]
    assert set(stages) == set(STAGES) and all(seconds >= 0 for seconds in stages.values())
    assert sum(stages.values()) == pytest.approx(profile["wall_s"], abs=1e-3)
    assert min(stages["wait"], stages["h2d"], stages["forward"], stages["blend"], stages["d2h"]) > 0
    assert stages["wait"] == pytest.approx(profile["wait_s"], abs=1e-3)
    assert parallel["read"] > 0 and "device_forward" not in parallel  # no device events on a CPU
    log = (path.parent.parent / "logs" / "rank-0.log").read_text()
    started, wrote = (log_time(log, marker) for marker in (" INFO predicting ", " INFO rank 0 wrote "))
    assert sum(stages.values()) == pytest.approx((wrote - started).total_seconds(), rel=0.05)
    report(
        f"stage timeline of a detection rank ({profile['tiles']} tiles): "
        + ", ".join(f"{stage} {stages[stage]:.2f} s" for stage in STAGES)
        + f"; sum {sum(stages.values()):.2f} s, log {(wrote - started).total_seconds():.2f} s; read in its worker "
        f"{parallel['read']:.2f} s"
    )


def log_time(log: str, marker: str) -> datetime.datetime:
    """When a rank log's first line holding ``marker`` was written."""
    line = next(line for line in log.splitlines() if marker in line)
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.slow
def test_prediction_logs_its_ranks_table(profiled):
    _, path = profiled
    log = (path.parent.parent / "logs" / "rank-0.log").read_text()
    assert "predict profile, shard 0: 1 rank(s)" in log and "tiles/s" in log


@pytest.mark.slow
def test_scene_profile_gathers_every_rank_file(profiled, tmp_path):
    scene, path = profiled
    out = tmp_path / "predict_profile.json"
    written = write_scene_profile([path.with_suffix("")], out)
    assert json.loads(out.read_text()) == written
    assert [r["rank"] for r in written["ranks"]] == [0]
    assert written["total"]["tiles"] == scene.tiles
    table = format_profile_table(written, title="predict profile (x)").splitlines()
    assert table[0].startswith("predict profile (x): 1 rank(s)")
    assert table[1].split()[:3] == ["rank", "device", "strategy"]
    assert table[2].split()[:4] == ["0", "cpu", "window", str(scene.tiles)]
    assert table[3].split()[0] == "all"


def test_totals_add_rates_and_take_the_longest_wall():
    profile = summarize([rank(1, 30, 10.0, 1.0, output_s=0.5), rank(0, 40, 8.0, 2.0, output_s=1.3)])
    assert [r["rank"] for r in profile["ranks"]] == [0, 1]
    total = profile["total"]
    assert total["tiles"] == 70 and total["batches"] == 10 + 8 and total["wall_s"] == 10.0
    assert total["tiles_per_s"] == pytest.approx(40 / 8 + 30 / 10)
    assert total["wait_fraction"] == pytest.approx(3.0 / 18.0, abs=1e-4)
    assert total["output_fraction"] == pytest.approx(1.8 / 18.0, abs=1e-4)
    assert total["memory_peak_mb"] == 901.0 and total["host_rss_peak_mb"] == 1001.0


def test_records_without_a_profile_are_left_out(tmp_path):
    plain, profiled = tmp_path / "rank-0", tmp_path / "rank-1"
    write_rank_record(plain, [0])
    stored = {name: 0 for name in FIELDS} | {"stages": {}, "parallel": {}} | rank(1, 3, 1.0, 0.1)
    write_rank_record(profiled, [1], stored)
    assert read_rank_record(plain)["profile"] is None
    gathered = write_scene_profile([plain, profiled], tmp_path / "p.json")
    assert [r["rank"] for r in gathered["ranks"]] == [1]
