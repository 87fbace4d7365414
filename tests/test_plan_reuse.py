"""The main process reuses its stored plan and job files while nothing the plan read changed
(rasterscale.workflow.reuse): a second invocation opens no raster, reads no annotation and writes no job file, and
any change to what the plan read makes it build the plan again."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from affine import Affine

import snakemake_forks
from conftest import write_raster
from rasterscale.jobs import files, paths
from rasterscale.workflow import checks, reuse, storage
from rasterscale.workflow.reuse import main_plan, record_path
from rasterscale.workflow.storage import fingerprint
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


DAMAGES = {
    "the record cut short": lambda key: (
        record_path(key),
        "the stored plan's record cannot be read (JSONDecodeError: ",
    ),
    "the stored plan cut short": lambda key: (Path(paths.stored_plan(key)), "the stored plan cannot be read ("),
    "a batch's plan cut short": lambda key: (
        Path(paths.stored_batch_plans(key)) / "batch-0.json",
        "the stored plan cannot be read (JSONDecodeError: ",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_stored_plan_file_cut_short_is_built_again_with_one_warning(workdir, monkeypatch, damage):
    """A file of the stored plan cut to half (a copy interrupted, a disk that filled): the next invocation (or a
    job's re-parse, for a batch's plan) warns once naming the file, gives the plan built from scratch and no
    traceback; the file is written anew (a batch's plan removed, for the main process to write when jobs run)."""
    config = survey_config(workdir)
    key = fingerprint(config)
    first = main_plan(config)
    storage.store_batch_plans(first, key)
    whole = storage.job_plan(config)
    path, told = DAMAGES[damage](key)
    path.write_text(path.read_text()[: path.stat().st_size // 2])
    said: list[str] = []
    if damage.startswith("a batch"):
        job = storage.job_plan(config, ".", said.append, ["--target-jobs", "predict:batch=0,shard=0"])
        assert job == whole  # the whole stored plan, as a job of no batch reads it
    else:
        assert main_plan(config, warn=said.append) == first
    damaged = [line for line in said if "stored plan" in line]
    assert len(damaged) == 1 and damaged[0].startswith(f"{path}: {told}"), said
    assert damaged[0].endswith("; it is built again")
    if damage.startswith("a batch"):
        assert not path.exists()  # removed: the main process writes it anew when jobs are about to run
    else:
        again: list[str] = []
        assert main_plan(config, warn=again.append) == first and not [x for x in again if "stored plan" in x]


def test_snakemake_n_with_its_caches_cut_short_warns_and_plans_the_same_jobs(workdir):
    """The real dry run (a fork of Snakemake, as `snakemake -n` runs) with the header cache and the stored plan's
    record both cut short: one warning line each on stderr, no traceback, the same jobs planned."""
    config = survey_config(workdir)
    command = workflow_command(workdir, config, "-n")
    first = snakemake_forks.run(command, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    for path in (workdir / paths.HEADER_CACHE, workdir / record_path(fingerprint(config))):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = snakemake_forks.run(command, timeout=300)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    warned = [line for line in again.stderr.splitlines() if "cannot be read" in line]
    assert len(warned) == 2, again.stderr[-3000:]
    assert "main.json: the stored plan's record cannot be read (JSONDecodeError: " in warned[0]
    assert (
        "headers.sqlite: the header cache cannot be read (database disk image is malformed); it is made again"
        in (warned[1])
    )
    assert planned(again.stdout) == planned(first.stdout) and planned(first.stdout)["predict"] == 2


def planned(dry_run: str) -> dict[str, int]:
    """The jobs a dry run's output plans, by rule."""
    table = dry_run.split("Job stats:")[1].split("total")[0]
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.M)}
