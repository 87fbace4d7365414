"""Pre-flight checks of the DDP launch (scripts/rasterscale/runtime/preflight.py): one test per pitfall, at plan time
(the job's Slurm resources, `snakemake -n`) and in the launched process (srun's variables, the Trainer).

Every error is one line that names the fix. The same checks on a real Slurm cluster: tests/test_slurm_workflow.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import snakemake_forks
from conftest import REPO
from rasterscale.runtime.launchers import LOCAL, SRUN
from rasterscale.runtime.preflight import (
    Geometry,
    PreflightError,
    SlurmStep,
    check_devices_visible,
    check_launch,
    check_world_size,
    parse_tasks_per_node,
    srun_prefix,
)

TRAIN_2X4 = Geometry("train", devices=4, nodes=2)
PREDICT_4 = Geometry("predict", devices=4, nodes=1)
# What the srun launcher's resources (rasterscale.runtime.launchers.Srun.resources) are for these geometries.
RESOURCES_2X4 = {"nodes": 2, "cpus_per_task": 5, "mpi": "srun", "tasks_per_node": 4, "gres": "gpu:4"}
RESOURCES_SHARD_4 = {"nodes": 1, "cpus_per_task": 3, "mpi": "srun", "tasks_per_node": 4, "gres": "gpu:4"}


def raises_one_line(fn, *args, **kwargs) -> str:
    with pytest.raises(PreflightError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message and message.startswith("preflight: ")
    return message


# ---------------------------------------------------------------------------------------------------------
# Plan time: the job's resources against the config
# ---------------------------------------------------------------------------------------------------------


def test_srun_prefix_is_explicit_about_every_geometry_option():
    assert SRUN.prefix(TRAIN_2X4, RESOURCES_2X4, "slurm", 4) == (
        "srun --nodes=2 --ntasks-per-node=4 --cpus-per-task=5 --kill-on-bad-exit=1 "
    )
    assert SRUN.prefix(PREDICT_4, RESOURCES_SHARD_4, None, 0) == srun_prefix(1, 4, 3)


def test_one_rank_per_node_on_several_nodes_pins_one_task_per_node():
    resources = {"nodes": 2, "cpus_per_task": 1, "mpi": "srun", "tasks": 2, "slurm_extra": "--ntasks-per-node=1"}
    assert SRUN.prefix(Geometry("train", 1, 2), resources, None, 0) == srun_prefix(2, 1, 1)


def test_one_rank_on_one_node_needs_no_srun_of_its_own():
    # no `mpi` resource: the executor's jobstep runs the command as one task (srun -n1)
    assert SRUN.prefix(Geometry("predict", 1, 1), {"nodes": 1, "cpus_per_task": 2}, "slurm", 0) == ""


def test_local_launcher_starts_nothing_outside_slurm():
    for executor in (None, "local", "dryrun"):
        assert LOCAL.prefix(TRAIN_2X4, {}, executor, 0) == ""


def test_plan_ranks_without_srun():
    message = raises_one_line(LOCAL.prefix, Geometry("train", 2, 1), {}, "slurm", 0)
    assert "slurm.launcher is 'local'" in message and "--profile profiles/slurm" in message
    raises_one_line(LOCAL.prefix, Geometry("predict", 2, 1), {}, "slurm-jobstep", 0)
    assert LOCAL.prefix(Geometry("predict", 1, 1), {}, "slurm", 0) == ""  # one rank: nothing to start


def test_plan_ntasks_per_node_differs_from_devices():
    message = raises_one_line(SRUN.prefix, TRAIN_2X4, {**RESOURCES_2X4, "tasks_per_node": 2}, None, 0)
    assert "--ntasks-per-node=2 but train.devices=4" in message and "set train.devices: 2" in message
    extra = {"nodes": 2, "mpi": "srun", "tasks": 4, "slurm_extra": "--ntasks-per-node=2"}
    raises_one_line(SRUN.prefix, Geometry("train", 1, 2), extra, None, 0)


def test_plan_gpus_per_node_differ_from_devices_or_exceed_the_nodes():
    message = raises_one_line(SRUN.prefix, TRAIN_2X4, {**RESOURCES_2X4, "gres": "gpu:a100:2"}, None, 0)
    assert "2 GPUs per node (gres=gpu:a100:2) but train.devices=4" in message
    message = raises_one_line(SRUN.prefix, TRAIN_2X4, RESOURCES_2X4, None, 2)
    assert "a node has 2 GPUs (slurm.gpus_per_node)" in message


def test_plan_nodes_differ_from_num_nodes():
    message = raises_one_line(SRUN.prefix, TRAIN_2X4, {**RESOURCES_2X4, "nodes": 1}, None, 0)
    assert "--nodes=1 but train.nodes=2" in message
    message = raises_one_line(SRUN.prefix, PREDICT_4, {**RESOURCES_SHARD_4, "nodes": 2}, None, 0)
    assert "each shard runs on 1 node" in message and "predict.shards" in message


def test_plan_world_size_other_than_asked():
    without_mpi = {k: v for k, v in RESOURCES_2X4.items() if k != "mpi"}
    message = raises_one_line(SRUN.prefix, TRAIN_2X4, without_mpi, None, 0)
    assert "srun -n1" in message and "world size 1" in message
    message = raises_one_line(SRUN.prefix, TRAIN_2X4, {**RESOURCES_2X4, "tasks": 4}, None, 0)
    assert "--ntasks=4 but 8 ranks" in message


# ---------------------------------------------------------------------------------------------------------
# In the launched process: srun's variables
# ---------------------------------------------------------------------------------------------------------


def step_env(ntasks: int, nnodes: int, per_node: str, procid: int = 0) -> dict[str, str]:
    """The variables srun sets in a task (checked on Slurm 22.05)."""
    return {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NNODES": str(nnodes),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURMD_NODENAME": "n1",
    }


def test_tasks_per_node_lists_are_expanded():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]


def test_launch_outside_slurm_is_left_to_lightning():
    assert check_launch(TRAIN_2X4, {}) is None


def test_launch_matching_the_geometry():
    step = check_launch(TRAIN_2X4, step_env(8, 2, "4(x2)", procid=5))
    assert step == SlurmStep("42", "0", 8, 2, (4, 4), 5, "n1")


def test_launch_ranks_without_srun():
    batch = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}
    message = raises_one_line(check_launch, TRAIN_2X4, batch)
    assert "not started by srun" in message and "srun --nodes=2 --ntasks-per-node=4" in message
    assert check_launch(Geometry("predict", 1, 1), batch) is None  # one rank needs nobody to start others


def test_launch_one_task_step_would_silently_be_world_size_1():
    message = raises_one_line(check_launch, Geometry("predict", 2, 1), step_env(1, 1, "1"))
    assert "only task of Slurm step 42.0" in message and "silently run world size 1" in message


def test_launch_nodes_differ_from_num_nodes():
    message = raises_one_line(check_launch, Geometry("train", 2, 1), step_env(4, 2, "2(x2)"))
    assert "spans 2 nodes but the DDP world has 1" in message and "set train.nodes: 2" in message
    message = raises_one_line(check_launch, Geometry("predict", 2, 1), step_env(4, 2, "2(x2)"))
    assert "srun --nodes=1" in message


def test_launch_ntasks_per_node_differs_from_devices():
    message = raises_one_line(check_launch, Geometry("train", 2, 2), step_env(8, 2, "4(x2)"))
    assert "Slurm started 4 tasks per node (--ntasks-per-node=4) but train.devices=2" in message
    raises_one_line(check_launch, Geometry("train", 1, 1), step_env(2, 1, "2"))  # 2 copies of a 1-rank run


def test_world_size_checked_after_the_trainer_exists():
    message = raises_one_line(check_world_size, TRAIN_2X4, 1)
    assert "Lightning runs world size 1 but 8 ranks were asked for" in message
    check_world_size(TRAIN_2X4, 8)


def test_every_local_rank_needs_its_own_visible_gpu():
    message = raises_one_line(check_devices_visible, PREDICT_4, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1)" in message and "set predict.devices: 2" in message
    check_devices_visible(PREDICT_4, 4, {})


# ---------------------------------------------------------------------------------------------------------
# The runtime: Lightning inside a one-task step really runs world size 1; make_trainer refuses
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def one_task_step(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("SLURM_", "SRUN_", "SBATCH_")) or name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    env = {**step_env(1, 1, "1"), "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "predict"}
    env["SLURM_NODELIST"] = "localhost"
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_lightning_alone_silently_runs_world_size_1_in_a_one_task_step(one_task_step):
    import lightning as L
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", cluster_environment=SLURMEnvironment()),
        logger=False,
        enable_progress_bar=False,
    )
    assert trainer.world_size == 1  # the pitfall: devices=2 asked, one rank runs, no error
    raises_one_line(check_world_size, Geometry("predict", 2, 1), trainer.world_size)


def test_make_trainer_refuses_the_one_task_step_with_one_line(one_task_step, capsys):
    from rasterscale.runtime.ranks import RankLayout, make_trainer

    with pytest.raises(SystemExit) as exit_:
        make_trainer(RankLayout("cpu", 2, 1, "32-true", "predict"), logger=False)
    line = str(exit_.value.code)
    assert line.startswith("rasterscale: preflight: predict: this process is the only task of Slurm step 42.0")
    assert "\n" not in line


def test_run_spec_prediction_jobs_are_one_node_each():
    from rasterscale.config.schema import validate_config
    from rasterscale.runtime.ranks import rank_layout
    from rasterscale.settings import settings_of

    config = validate_config(
        {
            "scenes": {"a": {"path": "a.tif"}},
            "train": {"accelerator": "cpu", "devices": 2, "nodes": 3},
            "predict": {"accelerator": "cpu", "devices": 2, "nodes": 4},
        }
    )
    settings = settings_of(config)
    train, predict = rank_layout(settings, "train"), rank_layout(settings, "predict")
    assert (train.section, train.devices, train.nodes, train.world_size) == ("train", 2, 3, 6)
    assert (predict.section, predict.devices, predict.nodes, predict.world_size) == ("predict", 2, 1, 2)


# ---------------------------------------------------------------------------------------------------------
# The workflow: `snakemake -n -p --profile profiles/slurm` plans, and refuses bad plans with one line
# ---------------------------------------------------------------------------------------------------------

SLURM_2X4 = REPO / "tests/configs/slurm_2x4.yaml"


def snakemake(tmp_path, *args: str, config=SLURM_2X4, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    command += ["--directory", str(tmp_path), "--configfile", str(config), *args]
    return snakemake_forks.run(command, timeout=300, check=False, env=env)


def plan_line(line: str) -> bool:
    """A line of the plan's cost estimate (rasterscale.workflow.estimate), printed before any error of the DAG's."""
    return line.startswith("rasterscale: plan: ")


def resources_of(output: str, rule: str) -> dict[str, object]:
    """The `resources:` line of a rule's first job in a dry run's output."""
    block = output[output.index(f"rule {rule}:") :]
    line = re.search(r"^\s+resources: (.*)$", block, flags=re.M).group(1)
    pairs = dict(item.split("=", 1) for item in line.split(", "))
    return {k: int(v) if v.isdigit() else v for k, v in pairs.items()}


@pytest.fixture(scope="module")
def plan_2x4(tmp_path_factory):
    result = snakemake(tmp_path_factory.mktemp("plan"), "-n", "-p", "--profile", str(REPO / "profiles/slurm"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_dry_run_plans_2_nodes_x_4_gpus(plan_2x4):
    assert "wildcards: batch=0, shard=0" in plan_2x4 and "wildcards: batch=0, shard=1" in plan_2x4
    assert "srun --nodes=2 --ntasks-per-node=4 --cpus-per-task=5 --kill-on-bad-exit=1 " in plan_2x4  # training
    assert plan_2x4.count("srun --nodes=1 --ntasks-per-node=4 --cpus-per-task=3 --kill-on-bad-exit=1 ") == 2
    assert all(f"--out-dir results/tiny/predict/batch-0/shard-{s} " in plan_2x4 for s in (0, 1))  # the run: tiny
    train = resources_of(plan_2x4, "train")
    assert {k: train[k] for k in ("nodes", "mpi", "tasks_per_node", "cpus_per_task", "gres")} == {
        "nodes": 2,
        "mpi": "srun",
        "tasks_per_node": 4,
        "cpus_per_task": 5,
        "gres": "gpu:4",
    }
    assert "mpi" not in resources_of(plan_2x4, "tiles")  # CPU rules: ordinary one-task jobs


class FakeResources(dict):
    __getattr__ = dict.__getitem__


def sbatch_call(resources: dict) -> str:
    """The sbatch command the executor plugin would submit for a job with these resources."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    job = SimpleNamespace(resources=FakeResources(resources), threads=1, name="job", is_group=lambda: False)
    params = {"run_uuid": "u", "slurm_logfile": "x.log", "comment_str": "c"}
    params |= {"account": "-A acct", "partition": "-p gpu", "workdir": "/w"}
    return get_submit_command(job, params) + set_gres_string(job)


def test_executor_plugin_turns_the_plan_into_the_right_sbatch_options(plan_2x4):
    train = sbatch_call(resources_of(plan_2x4, "train"))
    for option in ("--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=5", "--gres=gpu:4", "-t 720", "--mem 64000"):
        assert option in train, train
    assert "--ntasks=" not in train and "--ntasks-per-gpu" not in train
    shard = sbatch_call(resources_of(plan_2x4, "predict"))
    assert all(o in shard for o in ("--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=3", "--gres=gpu:4"))


def test_one_gpu_per_node_on_two_nodes_plans_and_submits_one_task_per_node(tmp_path):
    import yaml

    config = yaml.safe_load(SLURM_2X4.read_text())
    config["train"].update(devices=1, nodes=2)
    config_path = tmp_path / "one_gpu.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = snakemake(tmp_path, "-n", "-p", "--profile", str(REPO / "profiles/slurm"), config=config_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=5 --kill-on-bad-exit=1 " in result.stdout
    call = sbatch_call(resources_of(result.stdout, "train"))
    for option in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gres=gpu:1"):
        assert option in call, call
    assert "--ntasks-per-gpu" not in call, call


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set-resources", "train:tasks_per_node=2"],
            "train: the job asks Slurm for --ntasks-per-node=2 but train.devices=4",
        ),
        (["--set-resources", "train:nodes=1"], "train: the job asks Slurm for --nodes=1 but train.nodes=2"),
        (["--set-resources", "train:tasks=4"], "--ntasks=4 but 8 ranks were asked for"),
        (["--config", "slurm={launcher: srun, gpus_per_node: 2}"], "a node has 2 GPUs (slurm.gpus_per_node)"),
    ],
    ids=["ntasks-per-node", "nodes", "world-size", "gpus-per-node"],
)
def test_dry_run_refuses_a_bad_plan_with_one_line(tmp_path, args, message):
    result = snakemake(tmp_path, "-n", "--profile", str(REPO / "profiles/slurm"), *args)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("rasterscale: ") and not plan_line(line)]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]


def test_slurm_executor_without_the_profile_stops_before_submitting(tmp_path):
    """`--executor slurm` without slurm.launcher: srun would run 2 ranks as one task: refused at run start."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(tmp_path / "no-cluster.conf")  # nothing could be submitted anyway
    result = snakemake(
        tmp_path,
        "--executor",
        "slurm",
        "--jobs",
        "1",
        "--default-resources",
        "slurm_account=none",
        config=REPO / "tests/configs/tiny.yaml",
        env=env,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("rasterscale: ") and not plan_line(line)]
    assert errors == [
        "rasterscale: preflight: train: 2 ranks (train.devices=2 x 1 node) in a Slurm job, but slurm.launcher is "
        "'local' so no srun would start them (Lightning would hang or silently run world size 1): run with "
        "--profile profiles/slurm (it sets slurm.launcher: srun)"
    ]
    assert not (tmp_path / ".snakemake/slurm_logs").exists()
