"""The GPU path (`make test-gpu`, `pytest -m gpu`): every schedule and planner on CUDA with NCCL,
exact against Lightning's ddp on the same devices (world 1, and world 2 where two GPUs exist), and
the profiler's figures measured at completion (CUDA events or a synchronize), not at enqueue.
Skipped, with the reason, on a machine without CUDA."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from conftest import WORKERS, max_abs_diff, per_link, run_worker  # noqa: E402
from deft_replay import replay  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: the GPU suite needs one")]

CASES = [
    "ddp",
    "wfbp",
    "dear",
    "deft",
    "deft-plan",
    "dear-profiled",
    "dear-mgwfbp",
    "wfbp-dear-model",
    "dear-bayes",
    "topk-whole",
    "mstopk-whole",
    "topk-sparse",
    "wfbp-streams",
    "dear-streams",
    "dear-streams-auto",
    "ddp-adamw",
    "wfbp-adamw",
    "dear-adamw",
    "deft-adamw",
    "dear-streams-adamw",
]
EXACT = [c for c in CASES if c not in ("ddp", "ddp-adamw", "topk-sparse")]
WORLDS = [1] + ([2] if GPUS >= 2 else [])


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"gpu-{world}")
    proc = run_worker("run_gpu.py", str(out), str(world), *CASES, timeout=1500)
    if proc.returncode != 0:
        pytest.fail(f"GPU runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return world, lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False), out


@pytest.mark.parametrize("case", EXACT)
def test_every_schedule_and_planner_equals_ddp_on_cuda(runs, case):
    world, load, _ = runs
    reference = "ddp-adamw" if case.endswith("-adamw") else "ddp"
    assert load(case)["optimizer"] == ("AdamW" if case.endswith("-adamw") else "SGD")
    for rank in range(world):
        diff, key = max_abs_diff(load(case, rank)["state"], load(reference, rank)["state"])
        assert diff <= 1e-5, f"{case}, rank {rank}: {key} differs from ddp by {diff:.3g}"
        if load(case, rank)["trace"]:
            assert per_link(load(case, rank)["trace"]) == per_link(load(case, 0)["trace"])


def test_sparse_exchange_keeps_its_residuals_on_the_device(runs):
    """Top-k at density 0.1 on CUDA: every residual lives on the rank's GPU, the weights stay finite
    and differ from ddp's (something was held back). On one GPU there is nothing to exchange: top-k is
    off, and the run is ddp's."""
    world, load, _ = runs
    result = load("topk-sparse")
    if world == 1:
        assert not result["residual_devices"] and max_abs_diff(result["state"], load("ddp")["state"])[0] <= 1e-5
        return
    assert result["residual_devices"] and all(d.startswith("cuda") for d in result["residual_devices"])
    assert all(torch.isfinite(v).all() for v in result["state"].values() if v.is_floating_point())
    assert max_abs_diff(result["state"], load("ddp")["state"])[0] > 1e-4


def test_profiled_times_are_completion_times(runs):
    """The profiler's per-bucket all-reduce against a synchronised wall clock: both > 0, within 2x (a
    future-timed figure on NCCL measures the enqueue, orders of magnitude below). Under a millisecond
    (one GPU: NCCL has nothing to move, so both figures are launch overheads of tens of microseconds,
    measured through different code) the band widens to 4x either way."""
    world, load, out = runs
    clock = torch.load(out / "clock.rank0.pt")
    profile = load("dear-profiled")["profile"]
    assert profile["summary"]["t_ff"] > 0 and profile["summary"]["t_bp"] > 0
    for profiled, measured in zip(clock["profiled"], clock["clock"]):
        assert profiled > 0 and measured > 0
        band = 2.0 if measured > 1e-3 else 4.0
        assert 1 / band <= profiled / measured <= band, (profiled, measured)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def watched_runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"gpu-watched-{request.param}")
    proc = run_worker(
        "run_deft.py",
        str(out),
        str(request.param),
        "watched-kept",
        "watched-stopped",
        timeout=900,
        env={"COMMSCHED_TEST_ACCELERATOR": "gpu"},
    )
    if proc.returncode != 0:
        pytest.fail(f"watched runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("case, verdict", [("watched-kept", "kept"), ("watched-stopped", "stopped")])
def test_a_compensated_stale_plan_and_its_watch_equal_the_replay_on_cuda(watched_runs, case, verdict):
    """A forced one-step-stale plan on CUDA: spike compensation and weight prediction in the optimizer's
    step, the watch's verdict after 3 iterations, and, when stopped, the rollback from its snapshot in
    host memory back onto the GPU, then an exact plan. The weights equal the single-process replay on
    the CPU (tests/deft_replay.py), which judges on its own losses."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import WATCH

    result = watched_runs(case)
    assert result["device"].startswith("cuda")
    expected, judged = replay(result, compensation="spike+predict", watch=(WATCH, True))
    assert judged == [verdict] and result["report"]["watch"][0].startswith(verdict)
    for rank in range(result["world"]):
        diff, key = max_abs_diff(expected, watched_runs(case, rank)["state"])
        assert diff <= 1e-5, f"{case}, rank {rank}: {key} differs from the replay by {diff:.3g}"


def test_step_marks_read_completion_without_holding_the_host_back():
    """`StreamMarks` (the step timer's clock on CUDA): a span the host queued in a few milliseconds but
    the GPU took far longer to run reads as the GPU's time, and nothing waited while it was queued."""
    from commsched.comm.device_time import StreamMarks

    device = torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=device)
    x = x @ x / (x @ x).norm()  # cuBLAS's first call makes its handle on the host (100 ms and more): not in the span
    marks = StreamMarks()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    start = StreamMarks.mark(device)
    for _ in range(40):
        x = x @ x
        x = x / x.norm()
    marks.add(start, StreamMarks.mark(device))
    queued = time.perf_counter() - started
    torch.cuda.synchronize(device)
    finished = time.perf_counter() - started
    (seconds,) = marks.seconds()
    assert queued < seconds / 4, (queued, seconds)
    assert 0.8 * finished <= seconds <= finished, (seconds, finished)
