"""The real workflow on a real (throwaway, 2-node, loopback) Slurm cluster with `snakemake --profile profiles/slurm`.

On the tiny config (CPU ranks; its demo scenes made locally first): training as multi-node DDP on 2 nodes x 1
rank, prediction split into 2 shard jobs of 2 ranks each (one per node), merge and evaluation as ordinary one-task
jobs; at the same time a segmentation config in 2 shard jobs (a raster task's rank files and merge; the launch is
the same for every task, and the instances task's shards are merged in tests/test_instances_workflow.py). The
merged layer must equal a local (`--cores 2`) run's with the same model file. Also on the cluster: a failing rank
takes its job down at once, and the in-process pre-flight checks turn bad launches into one-line errors.

Needs root and Debian's slurm packages (installed on demand by tests/slurm_cluster.py); skips with the reason
otherwise. Run with `pytest -s` to see the evidence (job ids, nodes, ranks).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import yaml

from conftest import REPO, report
from slurm_cluster import SlurmCluster
from workflow import (
    matched_fraction,
    rank_stems,
    rank_tile_ids,
    run_paths,
    run_workflow,
    tiny_config,
    workflow_command,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PROFILE = REPO / "profiles/slurm/config.yaml"
# each run's outputs, results/{run}/: the tiny config's model.name; the model files' stems (segmenter.pt, crowns.pt)
RUNS = {"detection": "results/tiny", "segmentation": "results/segmenter"}
# the executor's log path: .snakemake/slurm_logs/rule_<rule>/[<wildcard values joined by _>/]<jobid>.log
SUBMITTED = re.compile(
    r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+?)/(?:([^/\s]+)/)?[^/\s]+\.log"
)


def slurm_config() -> dict:
    """The tiny config on CPU ranks: training on 2 nodes x 1 rank, prediction in 2 shards x 2 ranks."""
    return tiny_config(
        train={"accelerator": "cpu", "devices": 1, "nodes": 2},
        predict={"accelerator": "cpu", "devices": 2, "shards": 2},
    )


def edited_profile(directory: Path, cluster: SlurmCluster) -> Path:
    """profiles/slurm with its edit block filled in for the test cluster, as a user would.

    Test-only additions: squeue for job states (no accounting database), quick status checks, kept job logs.
    """
    profile = yaml.safe_load(PROFILE.read_text())
    profile["default-resources"].update(
        slurm_account="rasterscale", slurm_partition=cluster.partition, runtime=15, mem_mb=1500
    )
    # CPU-only nodes: no GPUs to ask for (the rules' accelerator is cpu anyway), 4 GB per node for DDP jobs.
    profile["config"]["slurm"].update(partition="", gres="", gpus_per_node=0, mem_mb=4000)
    profile["config"]["slurm"].update(train_runtime=15, predict_runtime=15)
    profile.update(
        {
            "slurm-status-command": "squeue",
            "slurm-init-seconds-before-status-checks": 1,
            "seconds-between-status-checks": 1,
            "slurm-keep-successful-logs": True,
            "latency-wait": 5,
        }
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return directory


def cluster_env(cluster: SlurmCluster, directory: Path) -> dict[str, str]:
    """The cluster's environment, plus an `srun` that finds this cluster's slurm.conf.

    The executor's jobstep removes every SLURM_* variable (SLURM_CONF too) before it runs a rule's command; a
    real cluster's srun finds its slurm.conf at the default place, this throwaway cluster's lives in a temp
    folder. The shim only puts SLURM_CONF back and runs the real srun.
    """
    real_srun = shutil.which("srun", path=cluster.env["PATH"])
    assert real_srun, "srun not found"
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "srun"
    shim.write_text(f'#!/bin/sh\nSLURM_CONF={cluster.conf_path} exec {real_srun} "$@"\n')
    shim.chmod(0o755)
    return {**cluster.env, "PATH": f"{directory}:{cluster.env['PATH']}"}


def scontrol_job(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    proc = cluster.run(["scontrol", "show", "job", "-o", job_id], timeout=15)
    assert proc.returncode == 0, proc.stderr
    return dict(word.split("=", 1) for word in proc.stdout.split() if "=" in word)


PLACEMENT = re.compile(r"placement: rank (\d+)/(\d+) local_rank (\d+) .* slurm_job=(\d+) step=\S+ node=(\w+)")


def placements(log_dir: Path) -> list[tuple[int, int, int, str, str]]:
    """(rank, world, local_rank, slurm job, node) from every rank's own log under log_dir."""
    found = []
    for path in sorted(log_dir.glob("rank-*.log")):
        match = PLACEMENT.search(path.read_text())
        assert match, f"no placement line in {path}"
        rank, world, local, job, node = match.groups()
        found.append((int(rank), int(world), int(local), job, node))
    return found


@dataclass
class ClusterRun:
    """A workflow run on the cluster: its folder, its snakemake's output, its Slurm jobs by rule (and by
    ``predict/<batch>_<shard>``), its seconds."""

    workdir: Path
    output: str
    jobs: dict[str, list[str]]
    seconds: float


# The executor's wait between two status checks grows by 10 s each time none of its jobs has ended (up to 3 min: a
# fixed rule of snakemake-executor-plugin-slurm, no setting): on this cluster, whose jobs take seconds, a run spent
# most of its time waiting for jobs long ended (300 s a run, 180 s with this). The tests' snakemake checks every 2 s
# instead; what it submits, how, and how it reads the jobs' states are the plugin's own.
STEADY_STATUS_CHECKS = (
    "import sys; from snakemake_executor_plugin_slurm import Executor; "
    "Executor.next_seconds_between_status_checks = property(lambda self: 2, lambda self, value: None); "
    "from snakemake.cli import main; sys.argv[0] = 'snakemake'; main()"
)


def start_cluster_run(
    cluster: SlurmCluster, base: Path, config: dict, *targets: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    profile = edited_profile(base / "profile", cluster)
    command = workflow_command(base / "work", config, "--profile", str(profile), *targets)
    assert command[1:3] == ["-m", "snakemake"], command
    command[1:3] = ["-c", STEADY_STATUS_CHECKS]  # python -c: snakemake's own entry, after the one change above
    out = (base / "snakemake.out").open("w")
    environment = {**cluster_env(cluster, base / "bin"), **(env or {})}
    return subprocess.Popen(command, env=environment, stdout=out, stderr=subprocess.STDOUT)


def finish_cluster_run(cluster: SlurmCluster, base: Path, process: subprocess.Popen, started: float) -> ClusterRun:
    """Wait for a run started by :func:`start_cluster_run`; a failure fails the test with every log's tail."""
    try:
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    seconds, workdir = time.monotonic() - started, base / "work"
    output = (base / "snakemake.out").read_text()
    if process.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(workdir.glob("logs/**/*.log")))
        slurm_logs = "\n".join(
            f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(workdir.glob(".snakemake/slurm_logs/**/*.log"))
        )
        pytest.fail(
            f"slurm workflow in {base} failed ({process.returncode}):\n{output[-5000:]}\n{logs}\n{slurm_logs}\n"
            f"{cluster.log_tail()}"
        )
    jobs: dict[str, list[str]] = {}
    for job_id, rule, wildcards in SUBMITTED.findall(output):
        jobs.setdefault(rule, []).append(job_id)
        if rule == "predict":  # one rule, a job per (batch, shard): wildcards "<batch>_<shard>"
            jobs.setdefault(f"predict/{wildcards}", []).append(job_id)
    return ClusterRun(workdir, output, jobs, seconds)


def segmentation_inputs(run: Path) -> dict:
    """A segmentation config over one 4-band scene, with an untrained segmenter of raw bands (the machinery is under
    test): 2 shard jobs of 2 ranks."""
    from rasterscale.raster.bands import InputBands
    from rasterscale.tasks.segmentation.model import build_segmenter, save_segmenter
    from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig

    run.mkdir(parents=True)
    bands = InputBands(("red", "green", "blue", "nir"), (90.0, 100.0, 70.0, 110.0), (30.0, 30.0, 25.0, 50.0), raw=True)
    cfg = SegmenterConfig(("background", "tree"), patch_size=256, input=bands)  # four raw bands, as the config's
    save_segmenter(build_segmenter(cfg), cfg, run / "segmenter.pt")
    config = yaml.safe_load((REPO / "tests/configs/tiny_segmentation.yaml").read_text())
    config["scenes"]["tiny_test"].pop("annotations")
    config.update(
        model={"file": "segmenter.pt"},
        train={"scenes": []},
        predict={"scenes": ["tiny_test"], "accelerator": "cpu", "devices": 2, "shards": 2, "workers": 0},
    )
    return config


def with_s3_scene(config: dict) -> dict:
    """The segmentation config with the same raster on S3 as a second scene."""
    scenes = {**config["scenes"], "tiny_test_s3": {**config["scenes"]["tiny_test"], "path": S3_SCENE}}
    predict = {**config["predict"], "scenes": ["tiny_test", "tiny_test_s3"]}
    return {**config, "scenes": scenes, "predict": predict, "project": {"seams": False}}  # one raster: no seam


S3_BUCKET = "slurm"
S3_SCENE = f"s3://{S3_BUCKET}/tiny_test.tif"


@pytest.fixture(scope="module")
def cluster_runs(cluster, tmp_path_factory, s3_server) -> dict[str, ClusterRun]:
    """Two workflows submitted to the cluster at once (their jobs share its two nodes): the tiny detection config
    (training on 2 nodes, prediction in 2 shards) and a segmentation config (2 shards), each up to what its tests
    read: the detection run to its scores (its merge and evaluation jobs are under test), the segmentation run to
    its merged class map; no run builds the report's pages."""
    base = tmp_path_factory.mktemp("slurm-run")
    started = time.monotonic()
    segmentation_config = segmentation_inputs(base / "segmentation/work")
    configs = {"detection": slurm_config(), "segmentation": segmentation_config}
    # the demo's scenes made locally first, by the workflow (their job files then older than they are): their
    # synthesis is not what runs on the cluster under test
    demo = {"detection": ("tiny_train", "tiny_test"), "segmentation": ("tiny_test",)}
    for name, config in configs.items():
        scenes = (f"resources/demo/{scene}.tif" for scene in demo[name])
        run_workflow(base / name / "work", config, *scenes, fork_jobs=False)  # the cluster's jobs run plain Python
    s3_server.create_bucket(S3_BUCKET)
    s3_server.upload(base / "segmentation/work/resources/demo/tiny_test.tif", S3_BUCKET, "tiny_test.tif")
    configs["segmentation"] = with_s3_scene(segmentation_config)  # its S3 scene in the local scene's batch:
    shutil.rmtree(base / "segmentation/work" / RUNS["segmentation"])  # not the demo run's batches, kept as planned
    steps = {"detection": "score", "segmentation": "merge"}
    s3 = {**s3_server.environment(), **s3_server.credentials()}  # the runs' ranks inherit them, under Slurm too
    targets = {name: [run_paths(config).batch_record(steps[name], 0)] for name, config in configs.items()}
    targets["segmentation"].append(f"{RUNS['segmentation']}/tiny_test_s3/classes.tif")  # a batch of its own
    processes = {
        name: start_cluster_run(cluster, base / name, config, *targets[name], env=s3)
        for name, config in configs.items()
    }
    runs = {name: finish_cluster_run(cluster, base / name, proc, started) for name, proc in processes.items()}
    for name, run in runs.items():
        report(f"\n[slurm workflow, {name}] {run.seconds:.0f} s; Slurm jobs by rule: {run.jobs}")
    return runs


@pytest.fixture(scope="module")
def slurm_run(cluster_runs) -> tuple[Path, dict[str, list[str]]]:
    run = cluster_runs["detection"]
    return run.workdir, run.jobs


def test_training_runs_multi_node_ddp_on_both_nodes(cluster, slurm_run):
    workdir, jobs = slurm_run
    (job_id,) = jobs["train"]
    info = scontrol_job(cluster, job_id)
    report(
        f"[train] job {job_id}: {info['JobState']} NodeList={info['NodeList']} NumNodes={info['NumNodes']}"
        f" NumTasks={info['NumTasks']} CPUs/Task={info['CPUs/Task']}"
    )
    assert info["JobState"] == "COMPLETED"
    assert (info["NumNodes"], info["NumTasks"]) == ("2", "2")
    ranks = placements(workdir / "logs/train/tiny")
    for rank in ranks:
        report(f"[train] rank {rank[0]}/{rank[1]} local_rank {rank[2]} job {rank[3]} node {rank[4]}")
    assert sorted((rank, world, local, job) for rank, world, local, job, _ in ranks) == [
        (0, 2, 0, job_id),
        (1, 2, 0, job_id),
    ]
    assert sorted(node for *_, node in ranks) == ["n1", "n2"]
    log = (workdir / "logs/train/tiny.log").read_text()
    assert "world_size=2" in log and "per_device_batch=2" in log and "effective_batch=4" in log
    assert "rank1 INFO" not in log  # only rank 0 reports progress; rank 1 keeps its own log
    assert (workdir / "results/models/tiny.pt").stat().st_size > 0


def test_prediction_shards_are_one_node_jobs_of_two_ranks_each(cluster, slurm_run):
    """Which node each shard job gets is Slurm's choice (the segmentation run shares the cluster): each is a job of
    its own, on one node, whose two ranks ran there."""
    workdir, jobs = slurm_run
    assert len(jobs["predict"]) == 2
    shard_jobs = {shard: jobs[f"predict/0_{shard}"] for shard in (0, 1)}
    assert shard_jobs[0] != shard_jobs[1]
    for shard, (job_id,) in shard_jobs.items():
        info = scontrol_job(cluster, job_id)
        report(
            f"[predict batch 0 shard {shard}] job {job_id}: {info['JobState']} NodeList={info['NodeList']}"
            f" NumNodes={info['NumNodes']} NumTasks={info['NumTasks']} CPUs/Task={info['CPUs/Task']}"
        )
        assert info["JobState"] == "COMPLETED"
        assert (info["NumNodes"], info["NumTasks"], info["CPUs/Task"]) == ("1", "2", "2")
        ranks = placements(workdir / f"logs/predict/batch-0/shard-{shard}")
        for rank in ranks:
            report(
                f"[predict batch 0 shard {shard}] rank {rank[0]}/{rank[1]} local_rank {rank[2]} job {rank[3]}"
                f" node {rank[4]}"
            )
        assert sorted(rank[:4] for rank in ranks) == [(0, 2, 0, job_id), (1, 2, 1, job_id)]
        assert {node for *_, node in ranks} == {info["NodeList"]} and info["NodeList"] in ("n1", "n2")
    assert "demo" not in jobs  # made locally before the run
    assert list(workdir.glob(".snakemake/rasterscale/plan-*/batch-0.json"))  # the batch jobs' plan (their parse's)
    for rule in ("tiles", "tiles_batch_0", "merge_batch_0", "score_batch_0"):
        for job_id in jobs[rule]:  # CPU rules: ordinary one-task jobs
            info = scontrol_job(cluster, job_id)
            assert (info["JobState"], info["NumNodes"], info["NumTasks"]) == ("COMPLETED", "1", "1"), (rule, info)


def test_every_tile_predicted_exactly_once_across_shards_and_ranks(slurm_run):
    workdir, _ = slurm_run
    run = workdir / RUNS["detection"]
    manifest = gpd.read_parquet(run / "tiny_test/tiles.parquet")
    files = rank_stems(run, "tiny_test")
    assert [p.name for p in files] == [f"rank-{r}" for r in range(4)]
    assert [p.parent.parent.name for p in files] == ["shard-0", "shard-0", "shard-1", "shard-1"]
    processed = [np.asarray(ids) for ids in rank_tile_ids(run, "tiny_test")]
    assert all(len(ids) for ids in processed)
    assert sorted(np.concatenate(processed).tolist()) == sorted(manifest["tile_id"].tolist())


def test_merged_layer_equals_the_local_run(slurm_run, tmp_path):
    workdir, _ = slurm_run
    # Same raster, manifest and model file; locally one job, two ranks started by Lightning.
    layer, manifest = (f"{RUNS['detection']}/tiny_test/{name}" for name in ("detections.parquet", "tiles.parquet"))
    for name in ("resources/demo/tiny_test.tif", "resources/demo/tiny_test.gpkg", manifest):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(workdir / name, tmp_path / name)
    config = tiny_config(
        model={"file": str(workdir / "results/models/tiny.pt")},
        train={"scenes": []},
        predict={"accelerator": "cpu", "devices": 2},
    )
    started = time.monotonic()
    run_workflow(tmp_path, config, layer)  # model.file tiny.pt, model.name tiny (the tiny config's): the same run
    local = gpd.read_parquet(tmp_path / layer)
    slurm = gpd.read_parquet(workdir / layer)
    matched = matched_fraction(slurm, local, 0.99), matched_fraction(local, slurm, 0.99)
    report(
        f"[compare] local run {time.monotonic() - started:.0f} s: {len(local)} detections locally, {len(slurm)} on "
        f"Slurm; matched at IoU >= 0.99 both ways: {matched[0]:.3f} / {matched[1]:.3f}"
    )
    assert len(slurm) > 50
    assert len(slurm) == len(local)
    assert matched == (1.0, 1.0)


def test_segmentation_runs_two_shards_on_the_cluster(cluster, cluster_runs):
    """The segmentation task through the same launch, shard and record machinery: 2 shard jobs of 2 ranks."""
    from rio_cogeo.cogeo import cog_validate

    from rasterscale.jobs.rankfiles import read_tile_ids

    run = cluster_runs["segmentation"]
    shards = {key.split("/")[1]: job_ids for key, job_ids in run.jobs.items() if key.startswith("predict/")}
    assert sorted(shards) == ["0_0", "0_1"] and all(len(job_ids) == 1 for job_ids in shards.values())
    infos = {shard: scontrol_job(cluster, job_ids[0]) for shard, job_ids in shards.items()}
    report(f"[segmentation on slurm] shard jobs {shards} on nodes {[i['NodeList'] for i in infos.values()]}")
    for info in infos.values():
        assert (info["JobState"], info["NumNodes"], info["NumTasks"]) == ("COMPLETED", "1", "2")
    outputs = run.workdir / RUNS["segmentation"]
    manifest = gpd.read_parquet(outputs / "tiny_test/tiles.parquet")
    stems = rank_stems(outputs, "tiny_test", ".tif")
    assert len(stems) == 4
    processed = np.concatenate([read_tile_ids(stem) for stem in stems])
    assert sorted(processed.tolist()) == sorted(manifest["tile_id"].tolist())
    valid, errors, _ = cog_validate(str(outputs / "tiny_test/classes.tif"))
    assert valid, errors


def test_ranks_on_the_cluster_read_s3_with_the_credentials_they_inherit(cluster, cluster_runs, s3_server):
    """The segmentation run's second scene is its first's raster on the suite's S3 server: every rank of both shard
    jobs read it with the credentials of the environment the run was started in (sbatch and srun pass it on), and
    its class map is the local scene's. No job's script or command line, log or file holds a key."""
    run = cluster_runs["segmentation"]
    outputs = run.workdir / RUNS["segmentation"]
    with (
        rasterio.open(outputs / "tiny_test/classes.tif") as local,
        rasterio.open(outputs / "tiny_test_s3/classes.tif") as remote,
    ):
        assert (local.transform, local.crs) == (remote.transform, remote.crs)
        assert np.array_equal(local.read(), remote.read())
    assert len(rank_stems(outputs, "tiny_test_s3", ".tif")) == 4  # both shards' two ranks each read it
    scripts = []
    for job_ids in run.jobs.values():
        for job_id in job_ids:
            written = cluster.run(["scontrol", "write", "batch_script", job_id, "-"], timeout=15)
            assert written.returncode == 0, written.stderr
            scripts.append(written.stdout)
    assert scripts and all("srun" in script or "python" in script for script in scripts)
    files = [p.read_bytes().decode("utf-8", "replace") for p in run.workdir.rglob("*") if p.is_file()]
    for text in (run.output, *scripts, *files):
        assert s3_server.secret_key not in text and s3_server.key_id not in text
    report(f"[slurm + S3] {len(scripts)} job scripts and {len(files)} files without a key; class maps identical")


PROBE = """
import sys
sys.path.insert(0, {scripts!r})
mode, devices, nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "check":  # the in-process checks alone (no torch import: fast)
    from rasterscale.runtime.preflight import Geometry, PreflightError, check_launch
    try:
        check_launch(Geometry("train", devices, nodes))
    except PreflightError as err:
        sys.exit(f"rasterscale: {{err}}")
    print("launch ok")
else:  # what train.py/predict.py do: the runtime's Trainer, checked before and after it is built
    from rasterscale.runtime.ranks import RankLayout, make_trainer
    make_trainer(RankLayout("cpu", devices, nodes, "32-true", "train"), logger=False)
    print("trainer built")
"""


def test_on_the_cluster_bad_launches_fail_fast_with_one_line(cluster, tmp_path):
    """In-process pre-flight checks inside real Slurm steps, and --kill-on-bad-exit ending a job at once."""
    from rasterscale.runtime.preflight import srun_prefix

    probe = f"{sys.executable} {tmp_path / 'probe.py'}"
    (tmp_path / "probe.py").write_text(PROBE.format(scripts=str(REPO / "scripts")))
    kill_test = "import os, sys, time; sys.exit(3) if os.environ['SLURM_PROCID'] == '1' else time.sleep(300)"
    steps = [
        ("one-task step, 2 ranks (Lightning)", f"srun -n1 --nodes=1 {probe} trainer 2 1"),
        ("one-task step, 2 ranks", f"srun -n1 --nodes=1 {probe} check 2 1"),
        ("batch script, no srun", f"{probe} check 2 1"),
        ("2 nodes for num_nodes=1", f"srun --nodes=2 --ntasks-per-node=1 {probe} check 1 1"),
        ("2 tasks per node for devices=1", f"srun --nodes=1 --ntasks-per-node=2 {probe} check 1 1"),
        ("good: 2 nodes x 1 task (Lightning)", f"{srun_prefix(2, 1, 1)}{probe} trainer 1 2"),
        ("rank 1 fails, rank 0 would sleep 300 s", f'{srun_prefix(1, 2, 1)}{sys.executable} -c "{kill_test}"'),
    ]
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        # what the executor's jobstep gives a rule's command: the job's SLURM_* variables gone (SLURM_CONF kept)
        "for v in $(env | sed -n 's/^\\(SLURM_[A-Za-z0-9_]*\\)=.*/\\1/p'); do case $v in"
        " SLURM_JOB_ID|SLURM_JOBID|SLURM_CLUSTER_NAME|SLURM_SUBMIT_DIR|SLURM_SUBMIT_HOST|SLURM_CONF) ;;"
        " *) unset $v;; esac; done\n"
        + "".join(
            f"echo '## {name}'; start=$(date +%s); {command} 2>&1; echo rc=$? seconds=$(( $(date +%s) - start ))\n"
            for name, command in steps
        )
    )
    out = tmp_path / "job.out"
    proc = cluster.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", f"--output={out}", str(script)], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    # polled (0.2 s), not sbatch --wait: its checks 2, 10 and 42 s after submission found this 15 s job at 42 s
    state = cluster.wait_job(job_id, timeout=300)
    text = out.read_text()
    report(f"\n[bad launches] job {job_id} ({state}):\n{text}")
    sections = dict(re.findall(r"## (.+?)\n(.*?)(?=\n## |\Z)", text, flags=re.S))
    expected = {
        "one-task step, 2 ranks (Lightning)": "is the only task of Slurm step",
        "one-task step, 2 ranks": "is the only task of Slurm step",
        "batch script, no srun": "was not started by srun",
        "2 nodes for num_nodes=1": "this srun step spans 2 nodes but the DDP world has 1",
        "2 tasks per node for devices=1": "Slurm started 2 tasks per node (--ntasks-per-node=2) but train.devices=1",
    }
    for name, message in expected.items():
        lines = [line for line in sections[name].splitlines() if line.startswith("rasterscale: preflight: ")]
        assert lines and all(message in line for line in lines), sections[name]
        assert "rc=0 " not in sections[name] and " built" not in sections[name] and " ok" not in sections[name]
    assert sections["good: 2 nodes x 1 task (Lightning)"].count("trainer built") == 2
    assert "rc=0 " in sections["good: 2 nodes x 1 task (Lightning)"]
    killed = re.search(r"rc=(\d+) seconds=(\d+)", sections["rank 1 fails, rank 0 would sleep 300 s"])
    assert killed and killed.group(1) != "0" and int(killed.group(2)) < 60, text
