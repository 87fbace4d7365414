"""The workflow deployed: the rules' conda environment generated from the pins (rasterscale.tools.condaenv), the CPU
rules' memory estimates (rasterscale.workflow.resources), and the workflow as a Snakemake module of another
workflow in another folder: from a local checkout (a dry run, then a prediction run whose outputs are the direct
run's), and from a URL (a remote module: a dry run with the package from the environment)."""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import geopandas as gpd
import pandas as pd
import pytest
import yaml

import snakemake_forks
from conftest import REPO, write_raster
from rasterscale.config.schema import validate_config
from rasterscale.grid.manifest import tile_offsets
from rasterscale.grid.project import Footprint, seam_name
from rasterscale.tools.condaenv import parse_requirements, render_environment
from rasterscale.workflow import resources
from rasterscale.workflow.plan import Plan
from rasterscale.workflow.steps import Steps, cog
from rasterscale.workflow.steps import demo as steps_demo
from workflow import jobs_planned, run_workflow

REQUIREMENTS = REPO / "envs/requirements.txt"
ENVIRONMENT = REPO / "envs/environment.yaml"


# -- the conda environment ---------------------------------------------------------------------------------------


def test_the_conda_environment_is_generated_from_the_requirements():
    assert ENVIRONMENT.read_text() == render_environment(REQUIREMENTS.read_text()), "run `make envs`"
    pins = [line.split(" #")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    environment = yaml.safe_load(ENVIRONMENT.read_text())
    pip = next(entry["pip"] for entry in environment["dependencies"] if isinstance(entry, dict))
    assert pip == [pin for pin in pins if pin and not pin.startswith("#")]  # every pin, no `-r requirements.txt`


def test_index_options_and_comments_are_kept_and_a_file_reference_is_one_line_naming_it():
    text = "# CPU wheels\n--extra-index-url https://download.pytorch.org/whl/cpu\ntorch==2.0.1  # cpu\nmoto[s3]==5.0\n"
    environment = yaml.safe_load(render_environment(text))
    assert environment["dependencies"][2]["pip"] == [
        "--extra-index-url https://download.pytorch.org/whl/cpu",
        "torch==2.0.1",
        "moto[s3]==5.0",
    ]
    assert "      # CPU wheels\n" in render_environment(text)
    with pytest.raises(ValueError) as err:
        parse_requirements("numpy==2.0\n-r dev.txt\n", "envs/requirements.txt")
    assert str(err.value).startswith("envs/requirements.txt, line 2: -r is not passed to conda's pip section")
    assert "\n" not in str(err.value)


# -- memory estimates -----------------------------------------------------------------------------------------------


def footprint(width: int, height: int, count: int = 3, dtype: str = "uint8", left: float = 0.0) -> Footprint:
    return Footprint("EPSG:32617", (left, 0.0, left + width * 0.1, height * 0.1), (0.1, 0.1), count, dtype)


def plan_of(footprints: dict[str, Footprint], batches: list[list[str]], **sections: dict) -> Plan:
    """A plan of predicted scenes of these footprints in these batches (no file is read)."""
    scenes = {name: {"path": f"{name}.tif"} for name in footprints}
    model = {"file": "model.pt", **sections.pop("model", {})}
    config = validate_config({"scenes": scenes, "model": model, "predict": {"scenes": list(footprints)}, **sections})
    members = {b: tuple(names) for b, names in enumerate(batches)}
    return Plan(config=config, footprints=footprints, members=members)


def test_estimates_grow_with_the_scene_and_are_whole_steps_above_the_process():
    small = plan_of({"a": footprint(1000, 1000)}, [["a"]])
    large = plan_of({"a": footprint(60_000, 60_000)}, [["a"]])
    floor = resources.job_mb(0)
    assert floor == 500  # 300 MB of process, with headroom, rounded up
    for step in ("tiles", "merge", "score"):
        low, high = (getattr(Steps(plan), step).mem_mb(0) for plan in (small, large))
        assert floor <= low < high and low % resources.STEP_MB == high % resources.STEP_MB == 0, step
    assert Steps(small).project.mem_mb() < Steps(large).project.mem_mb()
    # a 60,000 px square scene: 188 x 188 tiles of 400 px (80 px overlap); its mask and stretch read at 2000 px a
    # side (decimated by 30), its manifest's rows; 100 boxes a tile, read and merged
    tiles = 188 * 188
    assert Steps(large).tiles.mem_mb(0) == resources.job_mb(2000 * 2000 * (3 + 25) + tiles * 1200)
    assert Steps(large).merge.mem_mb(0) == resources.job_mb(2 * tiles * 100 * 1200)


@pytest.mark.parametrize("length", [1, 127, 128, 129, 224, 225, 1000, 60_000])
def test_the_tiles_counted_are_those_of_the_manifest(length):
    assert resources.tiles_along(length, 128, 32) == len(tile_offsets(length, 128, 32))


def test_a_batch_is_estimated_by_its_largest_scene_and_a_project_by_all_of_them():
    plan = plan_of({"a": footprint(2000, 2000), "b": footprint(20_000, 20_000)}, [["a"], ["b"], ["a", "b"]])
    merge = Steps(plan).merge
    assert merge.mem_mb(2) == merge.mem_mb(1) > merge.mem_mb(0)
    objects = sum(resources.merge_bytes(plan, name) for name in ("a", "b"))
    assert Steps(plan).project.mem_mb() == resources.job_mb(objects)


def test_a_seam_counts_as_its_two_scenes_side_by_side():
    plan = plan_of({"a": footprint(3000, 2000), "b": footprint(3000, 2500, left=300.0)}, [["a", "b"]])
    assert resources.scene_size(plan, seam_name("a", "b")) == resources.SceneSize(6000, 2500, 3, 1)


def test_detections_per_tile_bounds_the_objects_and_a_dense_merge_does_not_grow_with_the_height():
    scene = {"a": footprint(20_000, 20_000)}
    default, capped = plan_of(scene, [["a"]]), plan_of(scene, [["a"]], model={"detections_per_tile": 10})
    assert Steps(capped).merge.mem_mb(0) < Steps(default).merge.mem_mb(0)
    tall = plan_of({"a": footprint(5000, 100_000)}, [["a"]], task="segmentation")
    short = plan_of({"a": footprint(5000, 1000)}, [["a"]], task="segmentation")
    assert Steps(tall).merge.mem_mb(0) == Steps(short).merge.mem_mb(0)


def test_the_cog_conversion_is_its_gdal_cache_and_threads_and_a_demo_scene_its_synthesis():
    plan = plan_of({"a": footprint(50_000, 50_000, 4, "uint16")}, [["a"]], cog={"threads": 16})
    blocks = 16 * cog.BUFFERS_PER_THREAD * 512 * 512 * 4 * 2
    assert Steps(plan).cog.mem_mb("a") == resources.job_mb(cog.GDAL_CACHE_MB * resources.MB + blocks)
    demo = plan_of(
        {"a": footprint(100, 100)}, [["a"]], demo={"scenes": {"d": {"width": 4096, "height": 4096, "seed": 1}}}
    )
    assert Steps(demo).demo.mem_mb("d") == resources.job_mb(4096 * 4096 * steps_demo.BYTES_PER_PIXEL)
    # a training-only scene without a footprint: its demo size, else the unknown scene's
    assert resources.scene_size(demo, "d") == resources.SceneSize(4096, 4096, 3, 1)
    assert resources.scene_size(demo, "x").width == resources.UNKNOWN_SIDE


# -- the workflow as a module of another workflow ------------------------------------------------------------------

SCENE = "scene"
RUN = "model"  # the run's name: its model file's (model.pt), no model.name given
MERGED = f"results/{RUN}/{SCENE}/detections.parquet"
MANIFEST = f"results/{RUN}/{SCENE}/tiles.parquet"
CPU_RULES = ("tiles_batch_0", "merge_batch_0")


def module_snakefile(snakefile: str) -> str:
    return (
        'configfile: "config.yaml"\n\n\n'
        f"module rasterscale:\n    snakefile:\n        {snakefile!r}\n    config:\n        config\n\n\n"
        "use rule * from rasterscale\n"
    )


def run_module(folder: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """snakemake in ``folder`` (its Snakefile and config.yaml), as a user of the module runs it."""
    command = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    result = snakemake_forks.run(command, cwd=folder, timeout=600, env=env)
    if check and result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("logs/**/*.log")))
        raise AssertionError(f"module run failed ({result.returncode}):\n{result.stderr[-4000:]}\n{logs}")
    return result


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """A random RGB raster and an untrained detector at score threshold 0 (plenty of boxes to compare), and the
    config of a one-rank prediction of it: absolute paths, the same config for every run."""
    import torch

    from rasterscale.tasks.detection.model import DetectorConfig, build_detector, save_detector

    data = tmp_path_factory.mktemp("data")
    raster = write_raster(data / "scene.tif", 420, 300)
    torch.manual_seed(0)
    detector = DetectorConfig(backbone="resnet18", patch_size=128, score_threshold=0.0)
    save_detector(build_detector(detector), detector, data / "model.pt")
    return {
        "scenes": {SCENE: {"path": str(raster)}},
        "tiling": {"patch_size": 128, "overlap": 32},
        "model": {"file": str(data / "model.pt"), "backbone": "resnet18", "score_threshold": 0.0},
        "train": {"scenes": []},
        "predict": {"scenes": [SCENE], "devices": 1, "batch_size": 4, "workers": 0, "accelerator": "cpu"},
    }


@pytest.fixture(scope="module")
def direct_run(inputs, tmp_path_factory) -> Path:
    """The tiny detection run of ``inputs``, run directly (the checkout's Snakefile) up to its merged layer."""
    direct = tmp_path_factory.mktemp("direct")
    run_workflow(direct, inputs, MERGED)
    return direct


@pytest.mark.slow
def test_as_a_module_from_another_folder_it_plans_and_predicts_what_the_direct_run_does(inputs, direct_run, tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(inputs))
    (folder / "Snakefile").write_text(module_snakefile(str(REPO / "Snakefile")))
    dry = run_module(folder, "-n", MERGED)
    assert "rule demo:" not in dry.stdout  # the module's config is the caller's, not the demo's over it
    for rule in CPU_RULES:
        job = dry.stdout[dry.stdout.index(f"rule {rule}:") :]
        assert "mem_mb=" in job[: job.index("\n\n")], f"{rule}: no mem_mb"
    run_module(folder, MERGED)
    direct = direct_run
    for path in (MANIFEST, MERGED):
        ours, theirs = gpd.read_parquet(folder / path), gpd.read_parquet(direct / path)
        assert len(ours) == len(theirs) > 0, path
        pd.testing.assert_frame_equal(pd.DataFrame(ours.drop(columns="geometry")), theirs.drop(columns="geometry"))
        assert ours.geometry.to_wkb().tolist() == theirs.geometry.to_wkb().tolist(), path
    assert len(gpd.read_parquet(folder / MERGED)) > 100  # a real comparison


@pytest.mark.slow
def test_a_changed_setting_reruns_the_jobs_whose_files_carry_it_and_no_other(inputs, direct_run):
    """Each job reads its settings from its job file, rewritten only when its content changes: a setting reruns the
    jobs that use it, from the first of them on; an unchanged config, nothing."""

    def planned(**sections: dict) -> dict[str, int]:
        config = {**inputs, **{key: {**inputs.get(key, {}), **value} for key, value in sections.items()}}
        return jobs_planned(direct_run, config, MERGED)

    job = direct_run / f"results/{RUN}/jobs/predict/batch-0.json"
    written = job.stat().st_mtime_ns
    assert planned() == {} and job.stat().st_mtime_ns == written  # the same plan: no job file written again
    assert planned(merge={"iou_threshold": 0.3}) == {"merge_batch_0": 1}
    assert planned(predict={"batch_size": 2}) == {"predict": 1, "merge_batch_0": 1}  # the merge reads predict too
    assert planned(tiling={"overlap": 16}) == {"tiles_batch_0": 1, "predict": 1, "merge_batch_0": 1}
    assert planned(evaluate={"iou_threshold": 0.3}) == {}  # no scoring job towards the merged layer
    assert planned() == {}  # back to the run's config: its files as they were


@pytest.fixture
def served_checkout() -> Iterator[str]:
    """This checkout served over HTTP on loopback: the URL of its Snakefile (a remote module's source)."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(REPO))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/Snakefile"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_as_a_remote_module_it_takes_the_package_from_the_environment_and_its_scripts_from_the_source_cache(
    inputs, served_checkout, tmp_path
):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(inputs))
    (tmp_path / "Snakefile").write_text(module_snakefile(served_checkout))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if subprocess.run([sys.executable, "-c", "import rasterscale"], env=env, capture_output=True).returncode:
        missing = run_module(tmp_path, "-n", MERGED, env=env, check=False)  # (unless this Python has it installed)
        assert missing.returncode == 1
        assert "rasterscale: the workflow is a remote module" in missing.stderr and "pip install -e" in missing.stderr
    installed = {**env, "PYTHONPATH": str(REPO / "scripts")}  # as `pip install -e` of a clone puts it on the path
    dry = run_module(tmp_path, "-n", "-p", MERGED, env=installed)
    commands = [shlex.split(line)[2:] for line in dry.stdout.splitlines() if line.startswith("Shell command: ")]
    scripts = [Path(command[1]) for command in commands if len(command) > 1 and command[1].endswith("tiles.py")]
    assert scripts and "source-cache" in scripts[0].parts and not scripts[0].is_relative_to(REPO), scripts
