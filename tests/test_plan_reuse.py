"""The main process reuses its stored plan and job files while nothing the plan read changed
(rasterscale.workflow.reuse): a second invocation opens no raster, reads no annotation and writes no job file, and
any change to what the plan read makes it build the plan again."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import shapely
from affine import Affine

import snakemake_forks
from conftest import UTM17N, write_raster
from rasterscale.errors import InputError
from rasterscale.jobs import files, paths
from rasterscale.raster import header_cache
from rasterscale.workflow import checks, reuse, storage
from rasterscale.workflow.reuse import main_plan, record_path
from rasterscale.workflow.storage import fingerprint
from test_header_cache import locked_by_another_process
from workflow import workflow_command


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def survey_config(workdir: Path) -> dict:
    """Two scenes from a scene table, side by side (a seam between them): a (annotated, trained on), b (striped:
    a warning each plan)."""
    (workdir / "rasters").mkdir(exist_ok=True)
    write_raster(workdir / "rasters/a.tif", 300, 300)
    beside = Affine(0.1, 0, 404030.0, 0, -0.1, 3285000.0)
    write_raster(workdir / "rasters/b.tif", 300, 300, tiled=False, transform=beside)
    (workdir / "a.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\na.tif,10,10,50,50,tree\n")
    (workdir / "scenes.tsv").write_text("name\tpath\tannotations\na\trasters/a.tif\ta.csv\nb\trasters/b.tif\t\n")
    return {
        "scenes": "scenes.tsv",
        "tiling": {"patch_size": 128, "overlap": 16},
        "train": {"scenes": ["a"], "validation_fraction": 0.5},
        "predict": {"scenes": "all", "scenes_per_job": 1},
    }


class Reads:
    """What a plan's building read (its raster checks, its annotation files) and the job files written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rasters: list[str] = []
        self.written: list[str] = []
        check_raster, write = checks.check_raster, files.JobFile.write

        def counted_check(path):
            self.rasters.append(str(path))
            return check_raster(path)

        def counted_write(job, path):
            written = write(job, path)
            if written:
                self.written.append(str(path))
            return written

        monkeypatch.setattr(checks, "check_raster", counted_check)
        monkeypatch.setattr(files.JobFile, "write", counted_write)

    def clear(self) -> None:
        self.rasters.clear()
        self.written.clear()


def test_a_second_invocation_reuses_the_plan_opening_no_raster_and_writing_no_job_file(workdir, monkeypatch):
    config = survey_config(workdir)
    reads = Reads(monkeypatch)
    said: list[str] = []
    first = main_plan(config, warn=said.append)
    assert set(reads.rasters) == {"rasters/a.tif", "rasters/b.tif"} and len(reads.written) > 5
    assert first.seams and first.untiled == {"b": ("rasters/b.tif",)}
    assert any("rasters/b.tif is striped" in line for line in said)
    assert record_path(fingerprint(config)).is_file()
    reads.clear()
    again: list[str] = []
    second = main_plan(config, warn=again.append)
    assert reads.rasters == [] and reads.written == []  # nothing checked, nothing written
    assert second == first and again == said  # the same plan, and its warnings said again
    # a job file deleted since: the plan is reused, and that file alone written again
    merge = Path(first.paths.job_file("merge", 1))
    merge.unlink()
    reads.clear()
    assert main_plan(config) == first
    assert reads.rasters == [] and reads.written == [str(merge)]
    reads.clear()
    main_plan(config)
    assert reads.rasters == [] and reads.written == []


def change_raster(workdir: Path) -> None:
    write_raster(workdir / "rasters/a.tif", 320, 300)


def add_sidecar(workdir: Path) -> None:
    (workdir / "rasters/a.tif.aux.xml").write_text("<PAMDataset/>")


def edit_annotations(workdir: Path) -> None:
    (workdir / "a.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\na.tif,10,10,60,60,tree\n")


def edit_table(workdir: Path) -> None:
    table = workdir / "scenes.tsv"
    table.write_text(table.read_text().replace("b\trasters/b.tif\t\n", ""))


def record_a_skip(workdir: Path) -> None:
    folder = workdir / "results/detector/jobs/skipped"
    folder.mkdir(parents=True)
    (folder / "other.json").write_text("{}")


def rewrite_batches(workdir: Path) -> None:
    """Another config of the run rewrote a batch's tiles job file (atomically, as job files are written)."""
    path = workdir / "results/detector/jobs/tiles/batch-0.json"
    (workdir / "new.json").write_text(path.read_text())
    os.replace(workdir / "new.json", path)


def new_code(workdir: Path) -> None:
    path = record_path(fingerprint(survey_config(workdir)))
    path.write_text(path.read_text().replace(f'"code":"{reuse.code_version()}"', '"code":"an-earlier-version"'))


@pytest.mark.parametrize(
    "change",
    [change_raster, add_sidecar, edit_annotations, edit_table, record_a_skip, rewrite_batches, new_code],
)
def test_a_change_to_anything_the_plan_read_builds_it_again(workdir, monkeypatch, change: Callable[[Path], None]):
    config = survey_config(workdir)
    reads = Reads(monkeypatch)
    first = main_plan(config)
    reads.clear()
    change(workdir)
    rebuilt = main_plan(config)
    assert reads.rasters != []  # built again: its checks opened the rasters
    if change is edit_table:
        assert list(rebuilt.scenes) == ["a"] != list(first.scenes)
    if change is change_raster:
        assert rebuilt.footprints["a"] != first.footprints["a"]
    reads.clear()
    assert main_plan(config) == rebuilt and reads.rasters == []  # and reused after that


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    from rasterscale.tasks.detection.model import build_detector, save_detector
    from rasterscale.tasks.detection.modelfiles import DetectorConfig

    cfg = DetectorConfig(backbone="resnet18", labels=("tree",), patch_size=128)
    path = tmp_path_factory.mktemp("model") / "detector.pt"
    save_detector(build_detector(cfg), cfg, path)
    return path


def test_a_glob_of_scenes_is_watched_for_new_matches(workdir, monkeypatch, model_file):
    config = survey_config(workdir) | {"scenes": "rasters/*.tif", "train": {"scenes": []}}
    config["model"] = {"file": str(model_file)}
    reads = Reads(monkeypatch)
    assert list(main_plan(config).scenes) == ["a", "b"]
    reads.clear()
    main_plan(config)
    assert reads.rasters == []
    (workdir / "other").mkdir()
    write_raster(workdir / "other/c.tif", 300, 300, transform=Affine(0.1, 0, 406000.0, 0, -0.1, 3285000.0))
    os.replace(workdir / "other/c.tif", workdir / "rasters/c.tif")
    assert list(main_plan(config).scenes) == ["a", "b", "c"]


def test_a_plan_reading_a_vrt_gets_no_record_and_is_built_every_time(workdir, monkeypatch):
    import rasterio.shutil

    config = survey_config(workdir)
    rasterio.shutil.copy(workdir / "rasters/a.tif", workdir / "rasters/v.vrt", driver="VRT")
    config["scenes"] = {"a": {"path": "rasters/a.tif", "annotations": "a.csv"}, "v": {"path": "rasters/v.vrt"}}
    reads = Reads(monkeypatch)
    main_plan(config)
    assert not record_path(fingerprint(config)).exists()
    reads.clear()
    main_plan(config)
    assert "rasters/v.vrt" in reads.rasters  # its sources are not watched: checked again


def test_a_stored_plan_gone_or_not_the_recorded_one_is_built_again(workdir, monkeypatch):
    config = survey_config(workdir)
    reads = Reads(monkeypatch)
    first = main_plan(config)
    stored = workdir / paths.stored_plan(fingerprint(config))
    stored.unlink()
    reads.clear()
    assert main_plan(config) == first and reads.rasters != []  # built again (and stored)
    stored.write_text(stored.read_text().replace('"predicted":null', '"predicted":7'))  # not what was recorded
    reads.clear()
    assert main_plan(config) == first and reads.rasters != []


def test_a_model_folders_file_changed_in_place_builds_the_plan_again(workdir, monkeypatch):
    """A DeepForest model folder (config.json + model.safetensors) is read as one input: its label changed in
    place (the same size, the folder's mtime kept) gives the plan its new label."""
    import json

    from deepforest_files import torchvision_retinanet, write_folder

    folder = write_folder(workdir / "models/birds", torchvision_retinanet(), label_dict={"Tree": 0})
    config = survey_config(workdir) | {"model": {"file": "models/birds"}, "train": {"scenes": []}}
    config["scenes"] = {name: {"path": f"rasters/{name}.tif"} for name in "ab"}  # no annotations: any label goes
    assert main_plan(config).labels == ("Tree",)
    settings = folder / "config.json"
    stat = folder.stat()
    settings.write_text(settings.read_text().replace('"Tree"', '"Bird"'))
    os.utime(folder, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert json.loads(settings.read_text())["label_dict"] == {"Bird": 0}
    assert main_plan(config).labels == ("Bird",)


def test_a_left_out_scenes_raster_appearing_builds_the_plan_again(workdir, monkeypatch):
    config = survey_config(workdir) | {"scenes_on_error": "skip"}
    table = workdir / "scenes.tsv"
    table.write_text(table.read_text() + "c\tother/c.tif\t\n")
    assert main_plan(config).skipped.keys() == {"c"}
    (workdir / "other").mkdir()
    write_raster(workdir / "other/c.tif", 300, 300, transform=Affine(0.1, 0, 406000.0, 0, -0.1, 3285000.0))
    plan = main_plan(config)
    assert plan.skipped == {} and "c" in plan.predict_scenes


def test_an_input_changed_while_the_plan_is_built_leaves_no_record(workdir, monkeypatch):
    """A job of a run beside the dry run records a scene it left out while the plan is being built: the plan may
    not have seen it, so the next invocation builds it again."""
    config = survey_config(workdir)
    build = reuse.build_plan

    def build_while_a_job_writes(*args, **kwargs):
        plan = build(*args, **kwargs)
        add_sidecar(workdir)
        return plan

    monkeypatch.setattr(reuse, "build_plan", build_while_a_job_writes)
    main_plan(config)
    assert not record_path(fingerprint(config)).exists()
    monkeypatch.setattr(reuse, "build_plan", build)
    reads = Reads(monkeypatch)
    main_plan(config)
    assert reads.rasters != [] and record_path(fingerprint(config)).exists()


def tree_tops_of_a(workdir: Path) -> tuple[dict, Path, list, str]:
    """Regression of a height on scene a, scored against a's true tree tops: the config, the tops, geometries of the
    wrong kind for them (crowns) and the start of their one line."""
    survey_config(workdir)
    heights = np.linspace(0, 30, 300 * 300, dtype=np.float32).reshape(1, 300, 300)
    write_raster(workdir / "a.height.tif", 300, 300, count=1, data=heights)
    tops = workdir / "a.tops.gpkg"
    gpd.GeoDataFrame(geometry=[shapely.Point(404001 + 5 * k, 3284990) for k in range(4)], crs=UTM17N).to_file(tops)
    scene = {"path": "rasters/a.tif", "annotations": "a.height.tif", "tree_tops": "a.tops.gpkg"}
    config = {
        "task": "regression",
        "scenes": {"a": scene},
        "tiling": {"patch_size": 128, "overlap": 16},
        "train": {"scenes": ["a"], "validation_fraction": 0.5},
        "merge": {"tree_tops": {"min_height": 2}},
    }
    crowns = [shapely.box(404001 + 5 * k, 3284990, 404003 + 5 * k, 3284992) for k in range(4)]
    return config, tops, crowns, "a.tops.gpkg: feature 1 is a Polygon (4 of 4 features are no points); tree tops"


def polygons_of_a(workdir: Path) -> tuple[dict, Path, list, str]:
    """Segmentation of scene a from its polygons: the config, the polygons, geometries of the wrong kind for them
    (tree tops) and the start of their one line."""
    survey_config(workdir)
    polygons = workdir / "a.gpkg"
    crowns = [shapely.box(404001 + 5 * k, 3284990, 404003 + 5 * k, 3284992) for k in range(4)]
    gpd.GeoDataFrame(geometry=crowns, crs=UTM17N).to_file(polygons)
    config = {
        "task": "segmentation",
        "scenes": {"a": {"path": "rasters/a.tif", "annotations": "a.gpkg"}},
        "tiling": {"patch_size": 128, "overlap": 16},
        "model": {"labels": ["background", "tree"]},
        "train": {"scenes": ["a"], "validation_fraction": 0.5},
    }
    tops = [shapely.Point(404001 + 5 * k, 3284990) for k in range(4)]
    return config, polygons, tops, "a.gpkg: feature 1 is a Point (4 of 4 features are no polygons); segmentation"


@pytest.mark.parametrize("vector_input", [tree_tops_of_a, polygons_of_a])
def test_a_vector_input_rewritten_with_geometries_of_the_wrong_kind_stops_the_next_plan(
    workdir, monkeypatch, vector_input
):
    """The plan's geometry checks read a scene's vector files (true tree tops, segmentation's polygons), so its
    record watches them: the plan is reused while they stay, and one rewritten with geometries of the wrong kind
    stops the next invocation with its one line, as it stops a plan built from scratch."""
    config, path, wrong, told = vector_input(workdir)
    reads = Reads(monkeypatch)
    first = main_plan(config)
    record = reuse.PlanRecord.from_json(record_path(fingerprint(config)).read_text())
    assert str(path.relative_to(workdir)) in record.watched
    reads.clear()
    assert main_plan(config) == first and reads.rasters == []  # reused
    gpd.GeoDataFrame(geometry=wrong, crs=UTM17N).to_file(path)
    with pytest.raises(InputError) as raised:
        main_plan(config)
    assert str(raised.value).startswith(told) and "\n" not in str(raised.value), str(raised.value)


# the stored plan's files, by what the warning calls them
STORED = {
    "record": lambda key: record_path(key),
    "plan": lambda key: Path(paths.stored_plan(key)),
    "batch plan": lambda key: Path(paths.stored_batch_plans(key)) / "batch-0.json",
}


def cut_short(text: bytes) -> bytes:
    """Half the file (a copy interrupted, a disk that filled): JSON that ends mid-value."""
    return text[: len(text) // 2]


def garbage(text: bytes) -> bytes:
    """Other bytes in its place (not UTF-8, not JSON)."""
    return random.Random(0).randbytes(len(text))


def another_shape(text: bytes) -> bytes:
    """Valid JSON of this format, but not of the file's shape: a record's watched inputs, or a plan's batches, in
    the other kind of container."""
    data = json.loads(text)
    key = "watched" if "watched" in data else "members"
    data[key] = list(data[key].items()) if isinstance(data[key], dict) else {"0": data[key]}
    return json.dumps(data).encode()


# (file, damage) -> the error its warning names: a plan the record names is checked against the record's hash first
TOLD = {
    ("record", cut_short): "JSONDecodeError: ",
    ("record", garbage): "UnicodeDecodeError: ",
    ("record", another_shape): "ValueError: 'watched' is a list, not an object)",
    ("plan", cut_short): "ValueError: not the plan its record was written for: cut short or changed)",
    ("plan", garbage): "UnicodeDecodeError: ",
    ("plan", another_shape): "ValueError: not the plan its record was written for: cut short or changed)",
    ("batch plan", cut_short): "JSONDecodeError: ",
    ("batch plan", garbage): "UnicodeDecodeError: ",
    ("batch plan", another_shape): "ValueError: 'members' is an object, not a list)",
}


@pytest.mark.parametrize(("stored", "damage"), TOLD, ids=[f"{file}-{how.__name__}" for file, how in TOLD])
def test_a_damaged_stored_plan_file_is_built_again_with_one_warning(workdir, stored, damage):
    """A file of the stored plan cut short, garbage, or valid JSON of another shape: the next invocation (or a
    job's re-parse, for a batch's plan) warns once naming the file and why, and gives the plan built from scratch
    (no traceback, never a plan of the damaged file); the file is written anew (a batch's plan removed, for the main
    process to write when jobs run, as it does over one damaged in place)."""
    config = survey_config(workdir)
    key = fingerprint(config)
    first = main_plan(config)
    storage.store_batch_plans(first, key)
    whole = storage.job_plan(config)
    path = STORED[stored](key)
    path.write_bytes(damage(path.read_bytes()))
    said: list[str] = []
    if stored == "batch plan":
        job = storage.job_plan(config, ".", said.append, ["--target-jobs", "predict:batch=0,shard=0"])
        assert job == whole  # the whole stored plan, as a job of no batch reads it
    else:
        assert main_plan(config, warn=said.append) == first
    what = "stored plan's record" if stored == "record" else "stored plan"
    damaged = [line for line in said if "cannot be read" in line]
    assert len(damaged) == 1 and damaged[0].startswith(f"{path}: the {what} cannot be read ({TOLD[stored, damage]}")
    assert damaged[0].endswith("; it is built again") and "\n" not in damaged[0], damaged
    if stored == "batch plan":
        assert not path.exists()  # removed: the main process writes it anew when jobs are about to run
        other = path.with_name("batch-1.json")
        other.write_bytes(damage(other.read_bytes()))
        storage.store_batch_plans(first, key)  # onstart: over a damaged one too
        for number in (0, 1):
            written = path.with_name(f"batch-{number}.json").read_text()
            assert written == storage.plan_to_json(storage.plan_of_batch(first, number))
    else:
        again: list[str] = []
        assert main_plan(config, warn=again.append) == first and not [x for x in again if "cannot be read" in x]


def test_a_stored_plan_of_another_shape_is_refused_naming_its_first_misshapen_part(workdir):
    """A stored plan (a job reads it with no record to check it against) of this format but valid JSON of another
    shape is no plan: one line naming the first part that is not what plan_to_json writes (never a plan of it, nor
    a traceback when a rule reads it); its config is typed as it is loaded."""
    config = survey_config(workdir)
    path = Path(paths.stored_plan(fingerprint(config)))
    text = storage.plan_to_json(main_plan(config))
    assert storage.read_stored_plan(path) is not None
    changes = {
        "scope": (True, "'scope' is a boolean, not an integer or null"),
        "labels": ("tree", "'labels' is a string, not a list"),
        "members": ([[0, ["a", 3]]], "'members'[0][1][1] is an integer, not a string"),
        "inputs": ({"rasters/a.tif": [1, "2"]}, "'inputs'['rasters/a.tif'][1] is a string, not an integer"),
        "geometry": ({"train": ["train", 1, 1]}, "'geometry'['train'] is a list, not a list of 4"),
        "kept": (None, "the file has no key 'kept'"),
        "config": ({"model": 3}, "AttributeError: 'int' object has no attribute 'name'"),
    }
    for key, (value, told) in changes.items():
        data = json.loads(text)
        if key == "kept":
            del data[key]
        else:
            data[key] = value
        path.write_text(json.dumps(data))
        said: list[str] = []
        assert storage.read_stored_plan(path, said.append) is None and not path.exists()
        assert len(said) == 1 and told in said[0] and said[0].endswith("; it is built again"), (key, said)
    path.write_text(json.dumps([json.loads(text)]))
    said = []
    assert storage.read_stored_plan(path, said.append) is None
    assert said == [
        f"{path}: the stored plan cannot be read (ValueError: the file is a list, not an object); it is built again"
    ]


@dataclass
class FirstDryRun:
    """A survey's working folder after its first dry run (nothing stored before it: the plan from scratch): what it
    planned and said, the files it wrote, and a copy of .snakemake/rasterscale for each test to start from."""

    workdir: Path
    config: dict
    planned: dict[str, int]
    warnings: list[str]
    job_files: dict[str, bytes]
    stored_plan: bytes
    copy: Path

    @property
    def key(self) -> str:
        return fingerprint(self.config)

    def restore(self) -> None:
        """The stored files as the first dry run left them (their mtimes too)."""
        shutil.rmtree(self.workdir / paths.PLAN_DIR)
        shutil.copytree(self.copy, self.workdir / paths.PLAN_DIR)

    def dry_run(self, *args: str) -> subprocess.CompletedProcess:
        return snakemake_forks.run(workflow_command(self.workdir, self.config, "-n", *args), timeout=120)


def job_files(workdir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(workdir)): path.read_bytes() for path in sorted(workdir.glob("results/*/jobs/**/*.*"))}


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("rasterscale: warning: ")]


@pytest.fixture(scope="module")
def first_dry_run(tmp_path_factory) -> FirstDryRun:
    workdir = tmp_path_factory.mktemp("survey")
    config = survey_config(workdir)
    result = snakemake_forks.run(workflow_command(workdir, config, "-n"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    copy = tmp_path_factory.mktemp("stored") / "rasterscale"
    shutil.copytree(workdir / paths.PLAN_DIR, copy)
    stored = (workdir / paths.stored_plan(fingerprint(config))).read_bytes()
    found = FirstDryRun(
        workdir, config, planned(result.stdout), warnings_of(result.stderr), job_files(workdir), stored, copy
    )
    assert found.planned["predict"] == 2 and len(found.warnings) == 2 and found.job_files  # a notice, b striped
    return found


def header_cache_cut_short(run: FirstDryRun) -> str:
    record_path(run.key, run.workdir).unlink()  # the plan is built: its checks read the cache
    cache = run.workdir / paths.HEADER_CACHE
    cache.write_bytes(cut_short(cache.read_bytes()))
    return rf"{re.escape(paths.HEADER_CACHE)}: the header cache cannot be read \(database disk image is malformed\); "


def header_cache_garbage(run: FirstDryRun) -> str:
    record_path(run.key, run.workdir).unlink()
    cache = run.workdir / paths.HEADER_CACHE
    cache.write_bytes(garbage(cache.read_bytes()))
    return (
        rf"{re.escape(paths.HEADER_CACHE)}: the header cache cannot be read \(file is not a database\); it is made "
        r"again \(every raster's header is read this time\)$"
    )


def record_cut_short(run: FirstDryRun) -> str:
    path = record_path(run.key, run.workdir)
    path.write_bytes(cut_short(path.read_bytes()))
    return rf"{re.escape(str(record_path(run.key)))}: the stored plan's record cannot be read \(JSONDecodeError: "


def record_of_another_shape(run: FirstDryRun) -> str:
    path = record_path(run.key, run.workdir)
    path.write_bytes(another_shape(path.read_bytes()))
    return (
        rf"{re.escape(str(record_path(run.key)))}: the stored plan's record cannot be read \(ValueError: 'watched' is "
        r"a list, not an object\); it is built again$"
    )


def plan_cut_short(run: FirstDryRun) -> str:
    path = run.workdir / paths.stored_plan(run.key)
    path.write_bytes(cut_short(path.read_bytes()))
    return (
        rf"{re.escape(paths.stored_plan(run.key))}: the stored plan cannot be read \(ValueError: not the plan its "
        r"record was written for: cut short or changed\); it is built again$"
    )


@pytest.mark.parametrize(
    "damage",
    [header_cache_cut_short, header_cache_garbage, record_cut_short, record_of_another_shape, plan_cut_short],
)
def test_snakemake_n_over_a_damaged_cache_warns_once_and_plans_as_from_scratch(first_dry_run, damage):
    """The real dry run (a fork of Snakemake, as `snakemake -n` runs) with a damaged cache in place: the header
    cache cut short or garbage, the stored plan's record cut short or of another shape, the stored plan cut short.
    One warning line naming the file beside the plan's own, no traceback; the jobs planned, the job files and the
    stored plan those of the first dry run (from scratch); the damaged file made again (a header cache that fails
    after its opening: removed, for the next run to make)."""
    run = first_dry_run
    run.restore()
    told = damage(run)
    result = run.dry_run()
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = warnings_of(result.stderr)
    new = [line for line in said if line not in run.warnings]
    assert len(new) == 1 and len(said) == len(run.warnings) + 1, said
    assert re.match("rasterscale: warning: " + told, new[0]), new[0]
    assert planned(result.stdout) == run.planned and job_files(run.workdir) == run.job_files
    assert (run.workdir / paths.stored_plan(run.key)).read_bytes() == run.stored_plan
    assert reuse.PlanRecord.from_json(record_path(run.key, run.workdir).read_text()).digest  # written anew
    cache = run.workdir / paths.HEADER_CACHE
    if cache.exists():  # made again (or removed, when it failed after its opening: made by the next run)
        with contextlib.closing(sqlite3.connect(cache)) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_snakemake_n_over_a_header_cache_another_process_keeps_locked_goes_on_without_it(first_dry_run, monkeypatch):
    """A stuck process holds the header cache's lock: the dry run waits RASTERSCALE_LOCK_WAIT_S (not forever),
    then reads every header without the cache, one warning line, the same jobs; the file is left to its holder."""
    run = first_dry_run
    run.restore()
    record_path(run.key, run.workdir).unlink()  # the plan is built: its checks open the cache
    cache = run.workdir / paths.HEADER_CACHE
    kept = cache.read_bytes()
    monkeypatch.setenv(header_cache.LOCK_WAIT_VARIABLE, "0.5")
    with locked_by_another_process(cache):
        result = run.dry_run()
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = warnings_of(result.stderr)
    assert [line for line in said if line not in run.warnings] == [
        f"rasterscale: warning: {paths.HEADER_CACHE}: the header cache is locked by another process (database is "
        "locked for 0.5 s); every raster's header is read this time"
    ]
    assert len(said) == len(run.warnings) + 1 and cache.read_bytes() == kept
    assert planned(result.stdout) == run.planned and job_files(run.workdir) == run.job_files
    assert (run.workdir / paths.stored_plan(run.key)).read_bytes() == run.stored_plan


@pytest.mark.parametrize("damage", [cut_short, another_shape])
def test_a_jobs_parse_over_a_damaged_batch_plan_warns_once_and_loads_the_whole_plan(first_dry_run, damage):
    """A job's own parse of the Snakefile (Snakemake's --mode subprocess, the job of batch 0 as its command line
    names it; -n: parsed, not run) whose batch plan is damaged: one warning line naming it, no traceback, and the
    whole stored plan loaded (nothing checked again: the plan's notices are not said)."""
    run = first_dry_run
    run.restore()
    storage.store_batch_plans(storage.load_plan(run.key, run.workdir), run.key, run.workdir)  # as onstart does
    path = Path(paths.stored_batch_plans(run.key)) / "batch-0.json"
    (run.workdir / path).write_bytes(damage((run.workdir / path).read_bytes()))
    job = ("--mode", "subprocess", "--target-jobs", "predict:batch=0,shard=0", "--allowed-rules", "predict")
    result = run.dry_run(*job, "--cores", "1")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    told = f"rasterscale: warning: {path}: the stored plan cannot be read ("
    assert len(lines) == 1 and lines[0].startswith(told), lines
    assert lines[0].endswith("; it is built again") and not (run.workdir / path).exists()


def planned(dry_run: str) -> dict[str, int]:
    """The jobs a dry run's output plans, by rule."""
    table = dry_run.split("Job stats:")[1].split("total")[0]
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.M)}
