"""Many scenes: a scene table, a glob of rasters, `all`, a VRT mosaic as a scene, and scenes predicted in batches
(one job per batch and shard) with the same merged layers as one job per scene."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
from affine import Affine

import snakemake_forks
from conftest import write_raster, write_vrt
from prediction import PREDICT_SECTIONS, PredictScene
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError
from rasterscale.jobs.rankfiles import read_tile_ids
from rasterscale.raster.cog import striped_sources
from rasterscale.settings import job_settings
from workflow import matched_fraction, rank_stems, rank_tile_ids, run_workflow, workflow_command


def write_table(path: Path, rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_scene_table_is_the_mapping_form(workdir):
    write_table(
        workdir / "config/scenes.tsv",
        [
            ["name", "path", "annotations", "label_column", "bands"],
            ["# a comment line", "", "", "", ""],
            ["a", "rasters/a.tif", "boxes/a.gpkg", "species", "[3, 2, 1]"],
            ["b", "rasters/b.tif", "", "", ""],
        ],
    )
    config = validate_config({"scenes": "config/scenes.tsv", "predict": {"scenes": "all"}, "model": {"file": "m"}})
    assert config["scenes"] == {
        "a": {"path": "rasters/a.tif", "annotations": "boxes/a.gpkg", "label_column": "species", "bands": [3, 2, 1]},
        "b": {"path": "rasters/b.tif", "bands": [1, 2, 3]},  # cells of other types than strings are YAML
    }
    assert config["predict"]["scenes"] == ["a", "b"]


def test_all_trains_on_the_scenes_with_annotations():
    scenes = {"a": {"path": "a.tif", "annotations": "a.gpkg"}, "b": {"path": "b.tif"}, "c": {"path": "c.tif"}}
    config = validate_config({"scenes": scenes, "train": {"scenes": "all"}, "predict": {"scenes": "all"}})
    assert config["train"]["scenes"] == ["a"]
    assert config["predict"]["scenes"] == ["a", "b", "c"]


def test_a_glob_names_scenes_by_their_sanitized_stems(workdir):
    (workdir / "rasters").mkdir()
    for name in ("tile 1.tif", "tile.2.tif", "-x.tif"):
        (workdir / "rasters" / name).write_bytes(b"")
    config = validate_config({"scenes": "rasters/*.tif"})
    assert {name: scene["path"] for name, scene in config["scenes"].items()} == {
        "x": "rasters/-x.tif",
        "tile_1": "rasters/tile 1.tif",
        "tile_2": "rasters/tile.2.tif",
    }


@pytest.mark.parametrize(
    ("rows", "files", "message"),
    [
        (
            [["name", "raster"], ["a", "a.tif"]],
            [],
            "config/scenes.tsv line 1: unknown column 'raster' (allowed: name, path",
        ),
        ([["name", "annotations"], ["a", "a.gpkg"]], [], "config/scenes.tsv line 1: missing column 'path'"),
        ([["name", "path"], ["a", "a.tif"], ["a", "b.tif"]], [], "config/scenes.tsv line 3, column 'name': scene 'a'"),
        ([["name", "path"], ["a b", "a.tif"]], [], "config/scenes.tsv line 2, column 'name': 'a b' is not a scene"),
        ([["name", "path"], ["a", "a.tif", "x"]], [], "config/scenes.tsv line 2: 3 cells, but the header has 2"),
        (None, [], "scene table config/scenes.tsv not found"),
        (None, ["r/a.tif", "r/a.TIF"], None),
    ],
)
def test_table_and_glob_errors_are_one_line_naming_the_file_and_line(workdir, rows, files, message):
    scenes = "config/scenes.tsv"
    if rows is not None:
        write_table(workdir / scenes, rows)
    if files:
        for name in files:
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            (workdir / name).write_bytes(b"")
        scenes, message = "r/*", "the glob 'r/*' gives the scene name 'a' to both r/a.TIF and r/a.tif"
    with pytest.raises(ConfigError) as err:
        validate_config({"scenes": scenes})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_glob_matching_nothing_fails():
    with pytest.raises(ConfigError, match=re.escape("the glob 'nowhere/*.tif' matches no file")):
        validate_config({"scenes": "nowhere/*.tif"})


def test_train_and_predict_scenes_are_a_list_or_all():
    with pytest.raises(ConfigError, match=re.escape("key 'predict.scenes': 'every' does not match")):
        validate_config({"predict": {"scenes": "every"}})


# ---------------------------------------------------------------------------------------------------------
# A VRT mosaic as a scene
# ---------------------------------------------------------------------------------------------------------


def mosaic_tiles(directory: Path, tiled: bool = True, left: float = 404000.0) -> list[Path]:
    """2 x 2 GeoTIFF tiles of 170 x 140 px on one grid (the mosaic: 340 x 280 px), from x = ``left``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    return [
        write_raster(
            directory / f"tile_{row}{col}.tif",
            170,
            140,
            transform=Affine(0.1, 0, left + 17.0 * col, 0, -0.1, 3285000.0 - 14.0 * row),
            data=rng.integers(0, 255, size=(3, 140, 170), dtype=np.uint8),
            tiled=tiled,
        )
        for row in (0, 1)
        for col in (0, 1)
    ]


def test_a_vrt_reads_its_tiles_and_is_converted_only_when_a_source_is_striped(tmp_path):
    tiles = mosaic_tiles(tmp_path / "tiles")
    vrt = write_vrt(tmp_path / "mosaic.vrt", tiles)
    with rasterio.open(vrt) as src, rasterio.open(tiles[3]) as last:
        assert (src.width, src.height) == (340, 280)
        assert np.array_equal(src.read(window=((140, 280), (170, 340))), last.read())
    assert striped_sources(vrt) == []  # the VRT's own 128 px blocks, its sources tiled: read as it is
    striped = mosaic_tiles(tmp_path / "striped", tiled=False)
    assert striped_sources(write_vrt(tmp_path / "striped.vrt", striped)) == [str(p) for p in striped]


# ---------------------------------------------------------------------------------------------------------
# The workflow over a scene table: dry runs, errors at load, and batched prediction
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A scene table of three real scenes 1 km apart (two GeoTIFFs and a VRT mosaic of 4 tiles: no seams) and an
    untrained model file at score threshold 0 (plenty of boxes)."""
    root = tmp_path_factory.mktemp("scenes")
    model = PredictScene.make(root / "model")
    (root / "rasters").mkdir()
    write_raster(root / "rasters/a.tif", 300, 250)
    data = np.random.default_rng(3).integers(0, 255, (3, 300, 260), dtype=np.uint8)
    write_raster(root / "rasters/b.tif", 260, 300, data=data, transform=Affine(0.1, 0, 405000.0, 0, -0.1, 3285000.0))
    write_vrt(root / "rasters/mosaic.vrt", mosaic_tiles(root / "rasters/mosaic", left=406000.0))
    rows = [["name", "path"], ["a", "rasters/a.tif"], ["b", "rasters/b.tif"], ["mosaic", "rasters/mosaic.vrt"]]
    write_table(root / "config/scenes.tsv", rows)
    return root, model


RUN = "results/model"  # the run of PredictScene's model.pt, given as model.file without model.name: the file's stem


def table_config(model: PredictScene, **predict) -> dict:
    return {
        "scenes": "config/scenes.tsv",
        "model": {"backbone": "resnet18", "file": str(model.model_file), "score_threshold": 0.0},
        "tiling": {"patch_size": model.patch_size, "overlap": model.overlap},
        "predict": {"scenes": "all", "accelerator": "cpu", "workers": 0, "batch_size": 3, **predict},
    }


def dry_run(workdir: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    command = workflow_command(workdir, config, "-n", *args)
    return snakemake_forks.run(command, timeout=300, check=False)


def test_dry_run_plans_one_prediction_job_per_batch_and_shard(project):
    root, model = project
    # predict.nodes: the old name of predict.shards, still read, with a warning
    result = dry_run(root, table_config(model, devices=2, nodes=2, scenes_per_job=2), "-p")  # -p: the commands
    assert result.returncode == 0, result.stderr[-3000:]
    assert "key 'predict.nodes' is deprecated: it is now 'predict.shards'" in result.stderr
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", result.stdout, flags=re.M))
    assert {k: v for k, v in jobs.items() if k.startswith(("tile", "predict", "merge"))} == {
        "tiles_batch_0": "1",
        "tiles_batch_1": "1",
        "predict": "4",
        "merge_batch_0": "1",
        "merge_batch_1": "1",
    }
    predict_jobs = [job for job in result.stdout.split("rule ") if job.startswith("predict:")]
    for batch in (0, 1):
        for shard in (0, 1):
            job = next(job for job in predict_jobs if f"wildcards: batch={batch}, shard={shard}\n" in job)
            assert f"--job {RUN}/jobs/predict/batch-{batch}.json " in job and f" --shard {shard} " in job, job
    assert "cog" not in jobs  # the VRT's sources are tiled


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([["name", "path", "annotation"], ["a", "rasters/a.tif", ""]], "config/scenes.tsv line 1: unknown column"),
        ([["name", "annotations"], ["a", "x.gpkg"]], "config/scenes.tsv line 1: missing column 'path'"),
        (
            [["name", "path"], ["a", "rasters/a.tif"], ["c", "rasters/nowhere.tif"]],
            "rasterscale: rasters/nowhere.tif: raster not found (config/scenes.tsv line 3, column 'path')",
        ),
    ],
)
def test_scene_table_errors_are_one_line_at_dry_run(project, tmp_path, rows, message):
    root, model = project
    (tmp_path / "rasters").symlink_to(root / "rasters")
    write_table(tmp_path / "config/scenes.tsv", rows)
    result = dry_run(tmp_path, table_config(model))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# the targets: each scene's merged layer and prediction profile (the scoring, report and project jobs left out)
LAYERS = [
    f"{RUN}/{name}/{file}" for name in ("a", "b", "mosaic") for file in ("detections.parquet", "predict_profile.json")
]


@pytest.mark.slow
def test_batched_shards_account_every_tile_once_and_merge_as_one_rank_does(project, tmp_path):
    """3 scenes in one batch, 2 shards x 2 ranks: per-scene rank files (empty where a rank got none of a
    scene's tiles), every tile once; the merged layers equal those of one job of one rank. (That a batch predicts
    each scene as it alone would: test_one_job_over_two_scenes_predicts_each_as_alone.)"""
    root, model = project
    batched, single = tmp_path / "batched", tmp_path / "single"
    for workdir in (batched, single):
        for name in ("rasters", "config"):
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            (workdir / name).symlink_to(root / name)
    result = run_workflow(batched, table_config(model, devices=2, shards=2, scenes_per_job=3), *LAYERS)
    assert re.search(r"^predict\s+2$", result.stdout + result.stderr, flags=re.M)
    empty = 0
    for name in ("a", "b", "mosaic"):
        manifest = gpd.read_parquet(batched / RUN / name / "tiles.parquet")
        files = rank_stems(batched / RUN, name)
        assert [p.name for p in files] == [f"rank-{r}" for r in range(4)]
        processed = [np.asarray(ids) for ids in rank_tile_ids(batched / RUN, name)]
        empty += sum(len(ids) == 0 for ids in processed)
        assert sorted(np.concatenate(processed).tolist()) == sorted(manifest["tile_id"].tolist())
    assert empty > 0  # ranks own contiguous runs of the batch's tiles: some got none of a scene
    run_workflow(single, table_config(model, devices=1, shards=1, scenes_per_job=3), *LAYERS)
    for name in ("a", "b", "mosaic"):
        one = gpd.read_parquet(single / RUN / name / "detections.parquet")
        many = gpd.read_parquet(batched / RUN / name / "detections.parquet")
        assert len(many) > 20 and len(one) == len(many)
        assert matched_fraction(one, many, 0.99) == 1.0 and matched_fraction(many, one, 0.99) == 1.0
        profile = json.loads((batched / RUN / name / "predict_profile.json").read_text())
        assert profile["total"]["tiles"] == len(gpd.read_parquet(batched / RUN / name / "tiles.parquet"))


# ---------------------------------------------------------------------------------------------------------
# Inside a prediction job: the batch's tiles over shards and ranks, one scene's data at a time
# ---------------------------------------------------------------------------------------------------------


def test_batch_tiles_split_over_shards_and_ranks_exactly_once_and_balanced():
    from rasterscale.grid.sharding import batch_rank_tiles
    from rasterscale.grid.tile import Tile

    scenes = [[Tile(i, 0, 0, 8, 8) for i in range(n)] for n in (5, 0, 7, 1)]
    parts = [batch_rank_tiles(scenes, 2, shard, 2, rank) for shard in (0, 1) for rank in (0, 1)]
    assert sorted(sum(len(tiles) for tiles in part) for part in parts) == [3, 3, 3, 4]
    for index, tiles in enumerate(scenes):
        ids = sorted(t.tile_id for part in parts for t in part[index])
        assert ids == [t.tile_id for t in tiles]
    assert [len(tiles) for tiles in parts[3]] == [0, 0, 2, 1]  # empty for the scenes it has no tile of


def test_scenes_dataset_holds_one_scene_at_a_time_and_never_batches_two_tile_shapes():
    import gc
    import weakref

    from rasterscale.predict.batches import ScenesDataset

    made: list[weakref.ref] = []

    class Scene(list):
        pass

    def factory(tile_ids: list[int]):
        def make() -> Scene:
            gc.collect()
            assert all(ref() is None for ref in made), "the previous scene's data are still held"
            scene = Scene((None, tile_id) for tile_id in tile_ids)
            made.append(weakref.ref(scene))
            return scene

        return make

    dataset = ScenesDataset([factory([4, 5]), factory([]), factory([7, 8, 9])], [2, 0, 3], ["rgb 256", "-", "nir 512"])
    assert len(dataset) == 5
    assert [dataset[k][1] for k in range(5)] == [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]  # (scene, position)
    assert len(made) == 2  # the empty scene made nothing
    # batches in order, of 2, cut where the tile shape changes (a batch is one tensor)
    assert list(dataset.batches(2)) == [[0, 1], [2, 3], [4]]
    assert list(dataset.batches(4)) == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize("strategy", ["single", "batch"])
def test_one_job_over_two_scenes_predicts_each_as_alone(tmp_path, strategy):
    from rasterscale.config.schema import validate_config as validated
    from rasterscale.predict.engine import run_prediction
    from rasterscale.runtime.ranks import RankLayout
    from rasterscale.scene import Scene

    first = PredictScene.make(tmp_path / "first", 300, 200)
    second = PredictScene.make(tmp_path / "second", 250, 260)
    keys = {
        "task": "detection",
        "model": {"score_threshold": 0.0},
        "tiling": {"patch_size": PredictScene.patch_size, "overlap": PredictScene.overlap},
        "predict": {"strategy": strategy, "workers": 0, "batch_size": 4},
    }
    config = job_settings({key: validated(keys)[key] for key in PREDICT_SECTIONS})
    spec = RankLayout("cpu", 1, 1, "32-true")

    def job(scene: PredictScene) -> Scene:
        return Scene(scene.raster.parent.name, str(scene.raster), str(scene.manifest))

    run_prediction([job(first), job(second)], first.model_file, config, spec, tmp_path / "both", tmp_path / "logs")
    for scene in (first, second):
        name = scene.raster.parent.name
        run_prediction([job(scene)], first.model_file, config, spec, tmp_path / "alone", tmp_path / "logs")
        together = gpd.read_parquet(tmp_path / f"both/{name}/rank-0.parquet")
        alone = gpd.read_parquet(tmp_path / f"alone/{name}/rank-0.parquet")
        assert len(together) == len(alone) > 20
        assert matched_fraction(together, alone, 0.99) == 1.0
        assert sorted(read_tile_ids(tmp_path / f"both/{name}/rank-0")) == list(range(scene.tiles))
