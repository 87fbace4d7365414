import json
import shutil
import subprocess
import sys

import pytest
import yaml

import snakemake_forks
from conftest import REPO, schema_keys
from rasterscale.config.schema import load_config, load_schema, validate_config
from rasterscale.errors import ConfigError
from rasterscale.settings import settings_of
from workflow import tiny_config

MINIMAL = {"scenes": {"a": {"path": "a.tif"}}}


def test_defaults_are_filled_in():
    config = validate_config(MINIMAL)
    assert config["tiling"] == {"patch_size": 400, "overlap": 80, "skip_nodata": True}
    assert config["train"]["batch_size"] == 8 and config["train"]["lr_scaling"] == "linear"
    assert config["model"]["backbone"] is None  # the model file's, else resnet50: modelfiles.resolve_detector
    assert config["predict"]["devices"] == 1


def test_prediction_workers_are_left_to_the_ranks_cores_unless_set():
    assert "workers" not in validate_config(MINIMAL)["predict"]  # rasterscale.runtime.cores.rank_workers
    assert settings_of(validate_config(MINIMAL)).predict.workers is None
    assert settings_of(validate_config({**MINIMAL, "predict": {"workers": 0}})).predict.workers == 0


def test_every_schema_key_at_every_depth_has_a_description():
    """Each key a user can write is described; a free name ({name}: a scene) is described by its parent."""
    keys = list(schema_keys("", load_schema()))
    assert len(keys) > 80 and "train.warmup_steps" in dict(keys) and "scenes.{name}.scale.min" in dict(keys)
    missing = [path for path, node in keys if not path.endswith("{name}") and not node.get("description")]
    assert not missing, f"config/schema.yaml: keys without a description: {missing}"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"tiling": {"overlapp": 3}}, "unknown key 'tiling.overlapp'"),
        ({"trian": {}}, "unknown key 'trian'"),
        ({"train": {"batch_size": "8"}}, "key 'train.batch_size': '8' is not of type 'integer'"),
        ({"predict": {"devices": 0}}, "key 'predict.devices'"),
        ({"model": {"backbone": "resnet51"}}, "key 'model.backbone'"),
        ({"task": "instances", "model": {"mask_threshold": 0}}, "key 'model.mask_threshold': 0 is less than or equal"),
        ({"scenes": {"a": {"path": "a.tif", "anotations": "x"}}}, "unknown key 'scenes.a.anotations'"),
        ({"tiling": {"patch_size": 100, "overlap": 100}}, "'tiling.overlap' (100) must be smaller"),
        ({"train": {"scenes": ["b"]}}, "'train.scenes' names scene 'b'"),
        ({"train": {"scenes": ["a"]}}, "training scene 'a' has no 'annotations'"),
        ({"predict": {"scenes": ["a"]}}, "nothing to predict with"),
    ],
)
def test_errors_are_one_line_naming_the_key(patch, message):
    config = {**MINIMAL, **patch}
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


SHIPPED_CONFIGS = sorted(
    path
    for path in [*(REPO / "config").glob("*.yaml"), *(REPO / "tests/configs").glob("*.yaml")]
    if path.name != "schema.yaml"
)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda path: str(path.relative_to(REPO)))
def test_shipped_configs_are_valid(path):
    """Every shipped config (config/*.yaml but the schema, tests/configs/*.yaml) is valid as the workflow reads it:
    on its own (given with --configfile, a config replaces config/config.yaml)."""
    load_config(path)


def snakemake_dry_run(tmp_path, config: dict):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "snakemake", "-n", "--snakefile", str(REPO / "Snakefile")]
    return snakemake_forks.run([*command, "--directory", str(tmp_path), "--configfile", str(path)], timeout=120)


def test_dry_run_fails_with_one_line_on_a_config_typo(tmp_path):
    result = snakemake_dry_run(tmp_path, {**MINIMAL, "tiling": {"pach_size": 3}})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert errors == ["rasterscale: config: unknown key 'tiling.pach_size' (allowed: overlap, patch_size, skip_nodata)"]
    assert "Traceback" not in result.stderr


def test_dry_run_fails_on_a_missing_raster(tmp_path):
    result = snakemake_dry_run(tmp_path, {"scenes": {"a": {"path": "nowhere.tif"}}})
    assert result.returncode != 0
    assert "rasterscale: nowhere.tif: raster not found (scenes.a.path)" in result.stderr


@pytest.mark.parametrize("extra", [[], ["--configfile", "config/segmentation.yaml"]], ids=["demo", "segmentation demo"])
def test_the_readmes_demo_commands_plan_without_importing_torch(tmp_path, extra):
    """`snakemake -n` and `snakemake -n --configfile config/segmentation.yaml`, as the README gives them, from a
    folder holding config/ (as the repository root does): they plan, and import neither torch nor Lightning (a
    dry run reads model files' headers without them; Python's -X importtime lists every module imported)."""
    shutil.copytree(REPO / "config", tmp_path / "config")
    command = [sys.executable, "-X", "importtime", "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    command += ["--directory", str(tmp_path), "-n", "--cores", "2", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # no warning or error: the plan's cost estimate only (rasterscale.workflow.estimate)
    said = [line for line in result.stderr.splitlines() if "rasterscale:" in line]
    assert all(line.startswith("rasterscale: plan: ") for line in said) and "train" in result.stdout
    imported = {
        line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "rasterscale.tasks" in imported and "yaml" in imported  # the list is real
    heavy = imported & {"torch", "lightning", "segmentation_models_pytorch"}
    assert not heavy, f"the dry run imported {sorted(heavy)}"


def test_a_configfile_replaces_the_demo_config(tmp_path):
    """From a folder holding config/config.yaml (the Snakefile's configfile), a config given with --configfile
    replaces it (Snakemake would merge them): `predict.scenes: all` plans that config's scenes, none of the demo's."""
    shutil.copytree(REPO / "config", tmp_path / "config")
    mine = tmp_path / "my.yaml"
    mine.write_text(yaml.safe_dump(tiny_config(predict={"scenes": "all"})))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path)]
    result = snakemake_forks.run([*command, "-n", "--configfile", str(mine)], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # the scenes the batches' job files (written by the dry run) predict, each under its run (a seam has a '+')
    batches = tmp_path.glob("results/*/jobs/tiles/batch-*.json")
    scenes = {(path.parts[-4], s["name"]) for path in batches for s in json.loads(path.read_text())["scenes"]}
    planned = {(run, name) for run, name in scenes if "+" not in name}
    assert planned == {("tiny", "tiny_train"), ("tiny", "tiny_test")}, planned  # under the config's run: tiny
    assert "demo_" not in result.stdout
