"""Two ranks on one GPU (`make test-gpu`): each rank a process of its own computing on `cuda:0`, the two
talking over gloo through host memory (NCCL refuses two ranks on one device). A machine with a single
GPU then checks what one rank alone cannot: that a rank waits for the data its peer sent, that a CUDA
bucket staged for a gloo link is copied in order with the compute stream both ways, that the
profiler times completion across processes, that a dead peer ends the run with a message, and that
Ctrl-C stops both ranks at one step and resumes exactly.

Each rank is started here as a node of a two-node run (`NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`),
which is Lightning's own multi-node launch: ``Trainer(num_nodes=2, devices=1)``.

On a machine without CUDA (CI) the same tier runs on the CPU, outside the `gpu` mark: two nodes on
the loopback, every check but the device the tensors live on, so the harness a lent GPU will run
is itself kept working (`COMMSCHED_TEST_ACCELERATOR=cpu` asks for that on a GPU machine too).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_gpu import CASES as ONE_GPU_CASES  # noqa: E402

from commsched.comm.local_workers import free_port  # noqa: E402
from conftest import WORKERS, assert_same_as_reference, max_abs_diff, per_link  # noqa: E402

ON_CPU = os.environ.get("COMMSCHED_TEST_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
pytestmark = [] if ON_CPU else [pytest.mark.gpu]
DEVICE = "cpu" if ON_CPU else "cuda:0"
WORLD = 2

CASES = [*ONE_GPU_CASES, "dear-streams2"]
EXACT = [c for c in CASES if c not in ("ddp", "ddp-adamw", "topk-sparse")]


@dataclass
class Ended:
    """One rank's process once it ended."""

    returncode: int
    output: str


class Pair:
    """The two ranks, each a node of its own, in one process group of their own (as a terminal's
    foreground job: Ctrl-C reaches both); their output goes to files (a pipe left unread could stall
    one rank inside a collective the other waits on)."""

    def __init__(self, script: str, *args: str, logs: Path) -> None:
        port = str(free_port())
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"node{node}.log" for node in range(WORLD)]
        self.processes: list[subprocess.Popen] = []
        for node in range(WORLD):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "NODE_RANK": str(node),
                "COMMSCHED_TEST_SHARED_GPU": "1",
                "COMMSCHED_TEST_ACCELERATOR": "cpu" if ON_CPU else "gpu",
            }
            env.pop("LOCAL_RANK", None)
            if ON_CPU:
                env["OMP_NUM_THREADS"] = "1"
            with self.logs[node].open("w") as log:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKERS / script), *args],
                        cwd=WORKERS,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        process_group=0 if node == 0 else self.processes[0].pid,
                    )
                )

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *_: object) -> None:
        """Whatever happened in the test (a failed assertion, pytest's timeout), no rank is left running."""
        if any(p.poll() is None for p in self.processes):
            os.killpg(self.processes[0].pid, signal.SIGKILL)
            for process in self.processes:
                process.wait()

    def interrupt(self) -> None:
        os.killpg(self.processes[0].pid, signal.SIGINT)

    def wait(self, timeout: float) -> list[Ended]:
        deadline = time.monotonic() + timeout
        try:
            for process in self.processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.processes[0].pid, signal.SIGKILL)
            for process in self.processes:
                process.wait()
            pytest.fail(f"the two ranks did not end within {timeout:g} s:\n{self._tails()}")
        return [Ended(p.returncode, log.read_text()) for p, log in zip(self.processes, self.logs)]

    def _tails(self) -> str:
        return "\n".join(f"--- node {n}:\n{log.read_text()[-3000:]}" for n, log in enumerate(self.logs))


def run_pair(script: str, *args: str, logs: Path, timeout: float) -> list[Ended]:
    with Pair(script, *args, logs=logs) as pair:
        ended = pair.wait(timeout)
    for node, rank in enumerate(ended):
        assert rank.returncode == 0, f"node {node} ended with {rank.returncode}:\n{rank.output[-6000:]}"
    return ended


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("two-ranks")
    run_pair("run_gpu.py", str(out), str(WORLD), *CASES, logs=out / "logs", timeout=1500)
    return lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False), out


@pytest.mark.parametrize("case", EXACT)
def test_every_schedule_and_planner_equals_ddp_with_two_ranks_on_one_gpu(runs, case):
    load, _ = runs
    reference = "ddp-adamw" if case.endswith("-adamw") else "ddp"
    assert load(case)["optimizer"] == ("AdamW" if case.endswith("-adamw") else "SGD")
    for rank in range(WORLD):
        diff, key = max_abs_diff(load(case, rank)["state"], load(reference, rank)["state"])
        assert diff <= 1e-5, f"{case}, rank {rank}: {key} differs from ddp by {diff:.3g}"
    if load(case)["trace"]:
        assert per_link(load(case, 1)["trace"]) == per_link(load(case, 0)["trace"])


def test_both_ranks_computed_on_the_one_gpu_and_exchanged_something(runs):
    """Two ranks that saw different batches: their BatchNorm statistics differ (each updates them from
    its own batch), their weights are equal (the exchange averaged the gradients); top-k at density 0.1
    keeps its residuals on the rank's device and drifts from ddp (something was held back)."""
    load, _ = runs
    ranks = [load("ddp", rank)["state"] for rank in range(WORLD)]
    running = {k for k in ranks[0] if k.startswith("bn.running")}
    weights = [{k: v for k, v in state.items() if k not in running and v.is_floating_point()} for state in ranks]
    assert max_abs_diff(*weights)[0] == 0.0
    assert max(float((ranks[0][k] - ranks[1][k]).abs().max()) for k in running) > 1e-4
    sparse = load("topk-sparse")
    assert sparse["residual_devices"] and all(d == DEVICE for d in sparse["residual_devices"]), sparse[
        "residual_devices"
    ]
    assert max_abs_diff(sparse["state"], load("ddp")["state"])[0] > 1e-4


def test_profiled_collectives_are_completion_times_across_two_processes(runs):
    """The profiler's per-bucket all-reduce (two processes over gloo) against the same all-reduce timed
    here between two synchronises. The toy's buckets are a few hundred bytes: each time is the backend's
    latency and the machine's noise, so no bucket may be timed at a tenth of the clock or less (an
    enqueue would be far below it), and the buckets' median ratio is within 4x either way."""
    load, out = runs
    clock = torch.load(out / "clock.rank0.pt")
    profile = load("dear-profiled")["profile"]
    assert profile["world_size"] == WORLD and profile["backend"] == "gloo"
    assert profile["summary"]["t_ff"] > 0 and profile["summary"]["t_bp"] > 0
    ratios = [profiled / measured for profiled, measured in zip(clock["profiled"], clock["clock"])]
    assert ratios and all(r > 0.1 for r in ratios), list(zip(clock["profiled"], clock["clock"]))
    assert 0.25 <= statistics.median(ratios) <= 4.0, list(zip(clock["profiled"], clock["clock"]))


def test_a_peer_killed_mid_step_ends_the_other_with_the_message(tmp_path):
    started = time.monotonic()
    with Pair("run_gpu_pair.py", "peer-dies", str(tmp_path), logs=tmp_path / "logs") as pair:
        ended = pair.wait(240)
    survivor = ended[0]
    assert ended[1].returncode == 17
    assert survivor.returncode == 1, survivor.output[-3000:]
    assert "commsched.errors.PeerFailureError" in survivor.output, survivor.output[-3000:]
    assert "rank 1 (process " in survivor.output, survivor.output[-3000:]
    assert "commsched-test: rank 0 issuer threads alive at exit: []" in survivor.output, survivor.output[-3000:]
    assert time.monotonic() - started < 180


def test_ctrl_c_stops_both_ranks_at_one_step_and_the_resume_is_exact(tmp_path):
    interrupted = tmp_path / "interrupted"
    with Pair("run_gpu_pair.py", "interrupt", str(interrupted), logs=tmp_path / "logs-interrupted") as pair:
        _wait_for(interrupted / "started", pair)
        time.sleep(1.0)
        pair.interrupt()
        ended = pair.wait(180)
    for node, rank in enumerate(ended):
        assert rank.returncode == 130, f"node {node}:\n{rank.output[-3000:]}"
        assert "Traceback" not in rank.output, rank.output[-3000:]
    saved = torch.load(interrupted / "last.ckpt", weights_only=False)
    stopped = saved["global_step"]
    assert stopped > 5 and "commsched" in saved

    end = stopped + 3
    run_pair(
        "run_gpu_pair.py",
        "resume",
        str(tmp_path / "resumed"),
        str(end),
        str(interrupted / "last.ckpt"),
        logs=tmp_path / "logs-resumed",
        timeout=300,
    )
    run_pair("run_gpu_pair.py", "whole", str(tmp_path / "whole"), str(end), logs=tmp_path / "logs-whole", timeout=300)
    for rank in range(WORLD):
        got = torch.load(tmp_path / "resumed" / f"final.rank{rank}.pt")
        expected = torch.load(tmp_path / "whole" / f"final.rank{rank}.pt")
        assert got["step"] == expected["step"] == end and got["device"] == DEVICE
        for part in ("state", "momenta"):
            diff, key = max_abs_diff(got[part], expected[part])
            assert diff <= 1e-5, f"rank {rank}: {part} {key} differs by {diff:.3g} after resuming from step {stopped}"


SPARSE = ["sgd-wfbp", "sgd-dear", "adagrad-wfbp", "split-dear"]
"""Sparse embeddings (workers/run_sparse.py): their rows averaged apart from the buckets, staged through
the host for a gloo link; a pattern's reference is Lightning's ddp on the same setting."""


@pytest.fixture(scope="module")
def sparse_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("two-ranks-sparse")
    references = sorted({f"{case.split('-')[0]}-ddp" for case in SPARSE})
    run_pair("run_sparse.py", str(out), *references, *SPARSE, logs=out / "logs", timeout=900)
    return lambda case, rank: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("case", SPARSE)
def test_sparse_embeddings_equal_ddp_with_two_ranks_on_one_gpu(sparse_runs, case):
    assert "refused" not in sparse_runs(case, 0), sparse_runs(case, 0).get("refused")
    assert sparse_runs(case, 0)["device"] == DEVICE
    assert_same_as_reference(sparse_runs, case, f"{case.split('-')[0]}-ddp", 1e-5)


@pytest.mark.skipif(ON_CPU, reason="the bench's accelerator=gpu needs a CUDA device")
def test_the_bench_times_two_ranks_sharing_the_gpu(tmp_path):
    """`commsched-bench accelerator=gpu devices=2` on a one-GPU machine: each rank a node of its own on
    cuda:0, every entry over gloo; the table is written, and each run's weights, trained on the GPU,
    are compared with ddp's on the host (not across devices)."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "commsched.bench.cli", "accelerator=gpu", "devices=2", "width=8", "steps=3",
         "warmup=1", "rounds=1", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each runs as a node of its own on the first GPU" in proc.stdout
    rows = {row["schedule"]: row for row in json.loads((out / "results.json").read_text())[0]["rows"]}
    assert set(rows) == {"ddp", "wfbp", "dear"}
    assert all(row["step_ms"] > 0 and row["weights_vs_ddp"] < 1e-2 for row in rows.values()), rows


def _wait_for(path: Path, pair: Pair, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        ended: Optional[int] = next((p.returncode for p in pair.processes if p.poll() is not None), None)
        assert ended is None, f"a rank ended ({ended}) before the run was under way:\n{pair._tails()}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
