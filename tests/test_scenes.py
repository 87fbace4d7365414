"""Many scenes: a scene table, a glob of rasters, `all`, a VRT mosaic as a scene, and scenes predicted in batches
(one job per batch and shard) with the same merged layers as one job per scene."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rasterscale.config import ConfigError, validate_config


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
            ["name", "path", "annotations", "label_column"],
            ["# a comment line", "", "", ""],
            ["a", "rasters/a.tif", "boxes/a.gpkg", "species"],
            ["b", "rasters/b.tif", "", ""],
        ],
    )
    config = validate_config(
        {"scenes": "config/scenes.tsv", "predict": {"scenes": "all"}, "model": {"checkpoint": "m"}}
    )
    assert config["scenes"] == {
        "a": {"path": "rasters/a.tif", "annotations": "boxes/a.gpkg", "label_column": "species"},
        "b": {"path": "rasters/b.tif"},
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
    assert config["scenes"] == {
        "x": {"path": "rasters/-x.tif"},
        "tile_1": {"path": "rasters/tile 1.tif"},
        "tile_2": {"path": "rasters/tile.2.tif"},
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
