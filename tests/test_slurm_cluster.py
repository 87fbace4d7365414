"""The throwaway Slurm cluster harness (tests/slurm_cluster.py) really schedules across its two nodes.

Needs root and Debian's slurm packages (installed on demand); skips with the reason otherwise.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import pytest

from slurm_cluster import MARKER_VAR, SlurmCluster

pytestmark = pytest.mark.slurm


def conf_values(conf_path: Path) -> dict[str, list[str]]:
    """`Key=value` pairs of a slurm.conf; node lines are keyed `Port@<node>`."""
    values: dict[str, list[str]] = {}
    for line in conf_path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pairs = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if "NodeName" in pairs:
            values.setdefault(f"Port@{pairs['NodeName']}", []).append(pairs["Port"])
        else:
            for key, value in pairs.items():
                values.setdefault(key, []).append(value)
    return values


def ports_of(cluster: SlurmCluster) -> set[int]:
    values = conf_values(cluster.conf_path)
    ports = [int(values["SlurmctldPort"][0])] + [int(values[f"Port@{node}"][0]) for node in cluster.nodes]
    assert len(set(ports)) == len(ports), f"ports repeat within one cluster: {ports}"
    return set(ports)


def test_two_node_job_runs_ranks_on_both_nodes(cluster, tmp_path):
    assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
    out = tmp_path / "ranks.out"
    step = "srun --nodes=2 --ntasks-per-node=2 bash -c 'echo $SLURMD_NODENAME $SLURM_PROCID $SLURM_LOCALID'"
    proc = cluster.run(
        [
            "sbatch",
            "--parsable",
            "--wait",
            "--nodes=2",
            "--ntasks-per-node=2",
            f"--output={out}",
            "--wrap",
            step,
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}\n{cluster.log_tail()}"
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), proc.stdout

    lines = [line.split() for line in out.read_text().splitlines() if line.strip()]
    assert all(len(words) == 3 for words in lines), out.read_text()
    assert sorted(int(rank) for _, rank, _ in lines) == [0, 1, 2, 3], out.read_text()
    assert Counter(node for node, _, _ in lines) == {"n1": 2, "n2": 2}, out.read_text()
    for node in ("n1", "n2"):
        assert sorted(int(local) for name, _, local in lines if name == node) == [0, 1], out.read_text()

    # Without slurmdbd the executor plugin polls squeue: the finished job must stay visible there.
    assert cluster.job_state(job_id) == "COMPLETED"


def test_failed_and_cancelled_jobs_are_reported_by_squeue(cluster, tmp_path):
    proc = cluster.run(["sbatch", "--parsable", "--wait", "--output=/dev/null", "--wrap", "exit 3"], cwd=tmp_path)
    assert proc.returncode != 0
    failed = proc.stdout.strip().split(";")[0]
    assert cluster.job_state(failed) == "FAILED"

    proc = cluster.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 300"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    sleeper = proc.stdout.strip()
    assert cluster.run(["scancel", sleeper]).returncode == 0
    assert cluster.wait_job(sleeper, timeout=30) == "CANCELLED"


def marked_pids(cluster: SlurmCluster) -> list[int]:
    """Processes whose environment carries this cluster's marker (daemons' children, job processes)."""
    needle = f"{MARKER_VAR}={cluster.cluster_name}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_second_cluster_picks_other_ports_and_cleans_up(cluster, tmp_path_factory):
    first = ports_of(cluster)
    # a short folder: a test's own tmp_path (longer under pytest-xdist) leaves too little for the Unix sockets
    with SlurmCluster(tmp_path_factory.mktemp("c2"), nodes=("n1", "n2"), cpus_per_node=2) as second:
        assert second.cluster_name != cluster.cluster_name
        assert ports_of(second).isdisjoint(first)
        assert second.node_states() == {"n1": "idle", "n2": "idle"}
        proc = second.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", "true"])
        assert re.fullmatch(r"\d+", proc.stdout.strip()), f"{proc.stderr}\n{second.log_tail()}"
        assert second.wait_job(proc.stdout.strip(), timeout=60) == "COMPLETED"
        # Leave a job running: leaving the block must cancel it and end every process of this cluster.
        proc = second.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 300"])
        running = proc.stdout.strip()
        for _ in range(100):
            if second.job_state(running) == "RUNNING":
                break
            time.sleep(0.1)
        assert second.job_state(running) == "RUNNING"
        daemons = second.pids
        assert set(daemons) == {"munged", "slurmctld", "slurmd-n1", "slurmd-n2"}
        assert set(daemons.values()) <= set(marked_pids(second))
    assert second.pids == {}
    assert marked_pids(second) == []
    # Both ran at once without collision, and the first one still answers after the second stopped.
    assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
