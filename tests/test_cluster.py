"""commsched-cluster: a plain Lightning script run as an N-node cluster through Lightning's own
multi-node path ends with the weights of a 1-node run of the same world size; the emulated network
is removed after a normal run, a failing command and SIGTERM; bad flags are refused before
anything is created. CI runs as root; without root these tests are skipped, saying why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commsched.cluster import netns
from commsched.cluster.network import leftovers
from conftest import WORKERS, max_abs_diff

BIN = Path(sys.executable).parent
CAN_EMULATE = netns.unavailable_reason() is None
needs_root = pytest.mark.skipif(not CAN_EMULATE, reason=f"no emulated cluster here: {netns.unavailable_reason()}")
SCHEDULES = ["ddp", "wfbp", "dear"]


def cluster(*flags: str, command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "commsched-cluster"), *flags, "--", *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=WORKERS,
    )


def train_script(out: Path, nodes: int, devices: int) -> list[str]:
    return [sys.executable, str(WORKERS / "cluster_train.py"), str(out), str(nodes), str(devices), *SCHEDULES]


@needs_root
@pytest.mark.parametrize("nodes, per_node", [(2, 1), (2, 2)])
def test_a_multi_node_run_equals_a_one_node_run_of_the_same_world_size(tmp_path, nodes, per_node):
    proc = cluster(
        "--nodes",
        str(nodes),
        "--workers-per-node",
        str(per_node),
        "--rate",
        "1gbit",
        command=train_script(tmp_path / "cluster", nodes, per_node),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[node 0] cluster_train: dear done" in proc.stdout and f"world size {nodes * per_node}" in proc.stdout
    local = subprocess.run(
        train_script(tmp_path / "local", 1, nodes * per_node), capture_output=True, text=True, timeout=600, cwd=WORKERS
    )
    assert local.returncode == 0, local.stderr[-3000:]
    for schedule in SCHEDULES:
        diff, key = max_abs_diff(
            torch.load(tmp_path / "cluster" / f"{schedule}.pt"), torch.load(tmp_path / "local" / f"{schedule}.pt")
        )
        assert diff <= 1e-5, f"{schedule}: {key} differs by {diff:.3g}"
    assert leftovers() == []


def test_nodes_on_the_host_run_lightnings_multi_node_path_over_the_loopback(tmp_path, capfd):
    """`run_on_nodes(on_host=True)`, for ranks that cannot be one node's devices (several sharing one
    GPU): each node a plain process on this machine, no namespace made (no root needed), and the run
    ends where a one-node run of the same world size does."""
    from commsched.cluster.launch import run_on_nodes
    from commsched.cluster.spec import ClusterSpec
    from commsched.comm.local_workers import free_port

    before = leftovers()
    spec = ClusterSpec(2, 1, master_port=free_port())
    assert run_on_nodes(spec, train_script(tmp_path / "nodes", 2, 1), on_host=True) == 0
    said = capfd.readouterr().out
    assert "[node 0] cluster_train: dear done" in said and "world size 2" in said, said[-3000:]
    local = subprocess.run(
        train_script(tmp_path / "local", 1, 2), capture_output=True, text=True, timeout=600, cwd=WORKERS
    )
    assert local.returncode == 0, local.stderr[-3000:]
    for schedule in SCHEDULES:
        diff, key = max_abs_diff(
            torch.load(tmp_path / "nodes" / f"{schedule}.pt"), torch.load(tmp_path / "local" / f"{schedule}.pt")
        )
        assert diff <= 1e-5, f"{schedule}: {key} differs by {diff:.3g}"
    assert leftovers() == before


@needs_root
def test_commsched_train_starts_the_ranks_of_each_node(tmp_path):
    """`commsched-train` with two workers on each of two nodes: each node starts its own two ranks
    (Lightning would re-launch this command line for them, and `python -c` cannot be), and the run
    ends where a one-node run of four workers does."""
    train = [
        str(BIN / "commsched-train"),
        "schedule=wfbp",
        "model=small_cnn",
        "model.width=8",
        "data.batch_size=4",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=0",
        "checkpoint.enabled=false",
    ]
    proc = cluster(
        "--nodes",
        "2",
        "--workers-per-node",
        "2",
        "--rate",
        "1gbit",
        command=[*train, "trainer.num_nodes=2", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'cluster'}"],
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    local = subprocess.run(
        [*train, "trainer.devices=4", f"hydra.run.dir={tmp_path / 'local'}"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    on_cluster, on_one_node = (
        json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("cluster", "local")
    )
    assert on_cluster["world_size"] == on_one_node["world_size"] == 4
    assert on_cluster["steps"] == on_one_node["steps"] == 3
    assert abs(on_cluster["train_loss"] - on_one_node["train_loss"]) <= 1e-5
    assert leftovers() == []


@needs_root
def test_python_dash_m_runs_the_same_command():
    """`python -m commsched.cluster` as the cluster's docs say: the same CLI as commsched-cluster."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commsched.cluster",
            "--nodes",
            "2",
            "--rate",
            "100mbit",
            "--",
            sys.executable,
            "-c",
            "import os; print('node', os.environ['NODE_RANK'])",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WORKERS,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[node 0] node 0" in proc.stdout and "[node 1] node 1" in proc.stdout
    assert leftovers() == []


@needs_root
def test_the_nodes_get_lightnings_multi_node_environment_and_their_links(tmp_path):
    show = (
        "import os; print(*(f'{k}={os.environ.get(k)}' for k in ('NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT', "
        "'COMMSCHED_PRIMARY_IFNAME', 'COMMSCHED_SECONDARY_IFNAME')))"
    )
    proc = cluster(
        "--nodes",
        "3",
        "--rate",
        "100mbit",
        "--secondary-rate",
        "50mbit",
        command=["sh", "-c", f'ip -o -4 addr show; {sys.executable} -c "{show}"'],
    )
    assert proc.returncode == 0, proc.stderr
    for node in range(3):
        assert (
            f"[node {node}] NODE_RANK={node} MASTER_ADDR=10.123.0.1 MASTER_PORT=29500 "
            "COMMSCHED_PRIMARY_IFNAME=eth0 COMMSCHED_SECONDARY_IFNAME=eth1" in proc.stdout
        )
        assert f"10.123.0.{node + 1}/24" in proc.stdout and f"10.124.0.{node + 1}/24" in proc.stdout
    assert leftovers() == []


@needs_root
def test_the_worst_exit_status_wins_and_a_failing_node_ends_the_others(tmp_path):
    start = time.monotonic()
    proc = cluster(
        "--nodes", "2", "--grace", "2", command=["sh", "-c", 'if [ "$NODE_RANK" = 1 ]; then exit 7; fi; sleep 60']
    )
    assert proc.returncode == 7
    assert time.monotonic() - start < 40  # node 0 was ended after the grace period, not after its sleep
    assert leftovers() == []


@needs_root
def test_sigterm_removes_everything(tmp_path):
    process = subprocess.Popen(
        [str(BIN / "commsched-cluster"), "--nodes", "2", "--", "sleep", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(leftovers()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(leftovers()) == 3  # the switch and two nodes
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert leftovers() == []


@needs_root
def test_a_second_sigterm_while_stopping_kills_the_nodes_before_the_network_goes(tmp_path):
    """Nodes that ignore SIGTERM (as a worker hung in a collective does), and a second SIGTERM while
    the cluster waits for them: no node process outlives the run, nothing of the network is left."""
    marker = "97.125"  # an argument no other process has
    process = subprocess.Popen(
        [str(BIN / "commsched-cluster"), "--nodes", "2", "--", "sh", "-c", f"trap '' TERM; exec sleep {marker}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(running(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(running(marker)) == 2
    try:
        process.send_signal(signal.SIGTERM)
        time.sleep(1)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        assert running(marker) == [] and leftovers() == []
    finally:
        subprocess.run(["pkill", "-9", "-f", f"^sleep {marker}"])


def running(marker: str) -> list[str]:
    found = subprocess.run(
        ["pgrep", "-f", f"^sleep {marker}"], capture_output=True, text=True
    )  # the nodes, not the cluster
    return found.stdout.split()


@needs_root
def test_a_killed_runs_namespaces_are_removed_by_the_next_run_and_a_live_runs_are_kept():
    """SIGKILL leaves no chance to clean up: the next run removes namespaces whose maker is gone,
    and only those (a live maker's, like this test's own, stay)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan, alive = f"commsched-{gone.pid}-dead00-n0", netns.new_name("-n0")
    for name in (orphan, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        proc = cluster("--nodes", "2", "--rate", "100mbit", command=["true"], timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert f"removed 1 network namespace(s) left by a run that was killed: {orphan}" in proc.stderr
        assert leftovers() == [alive]
    finally:
        for name in (orphan, alive):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nodes", "0"], "--nodes=0"),
        (["--nodes", "2", "--rate", "fast"], "--rate='fast'"),
        (
            ["--nodes", "2", "--rate", "100mbit", "--flow-rate", "1gbit"],
            "--flow-rate='1gbit'; allowed: a rate at most --rate",
        ),
        (["--nodes", "2", "--workers-per-node", "0"], "--workers-per-node=0"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_created(flags, message):
    before = leftovers() if CAN_EMULATE else []
    proc = cluster(*flags, command=["true"], timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert (leftovers() if CAN_EMULATE else []) == before
