"""dear is exact whatever user code touches, and keeps its overlap when user code touches nothing
(`commsched.schedules.pending_tensors`): real 2-process runs against Lightning's ddp with the same code attached
(workers/run_touching.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, per_link, run_worker

TOLERANCE = 1e-5
STEPS = 8
VARIANTS = ["l2first", "shared", "readers", "rankzero", "clock"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("touching")
    proc = run_worker("run_touching.py", str(out), "2", *(f"{v}-{s}" for v in VARIANTS for s in ("ddp", "dear")))
    if proc.returncode != 0:
        pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dear_ends_where_ddp_ends(results, variant):
    for rank in (0, 1):
        diff, key = max_abs_diff(results(f"{variant}-dear", rank)["state"], results(f"{variant}-ddp", rank)["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs from ddp by {diff:.3g}"


def test_hooks_see_what_they_see_under_ddp(results):
    """Gradients read after backward (rank 0 only) and before the step, momentum buffers and weights
    after every step, deep copies and saved state dicts: all as under ddp."""
    for rank in (0, 1):
        dear, ddp = results("readers-dear", rank), results("readers-ddp", rank)
        for name in ("grad_seen", "momentum"):
            assert len(dear[name]) == len(ddp[name]) == STEPS, name
            assert max((a - b).abs().max().item() for a, b in zip(dear[name], ddp[name])) <= TOLERANCE, name
        assert len(dear["copies"]) == len(ddp["copies"]) == STEPS // 2
        for mine, theirs in zip(dear["copies"], ddp["copies"]):
            assert max_abs_diff(mine, theirs)[0] <= TOLERANCE
    for variant in ("readers", "rankzero"):
        dear, ddp = results(f"{variant}-dear"), results(f"{variant}-ddp")
        assert len(dear["norms"]) == STEPS and max(abs(a - b) for a, b in zip(dear["norms"], ddp["norms"])) <= TOLERANCE


def test_only_touches_bring_updates_forward(results):
    """Touching code brings pending tensors up to date; a callback that reads a clock touches nothing
    and every deferred update is applied where DeAR applies it, in the next forward."""
    for rank in (0, 1):
        clock = results("clock-dear", rank)
        assert clock["touches"] == 0
        assert clock["applied"]["forward"] == (STEPS - 2) * clock["buckets"], clock["applied"]
        assert "touch" not in clock["applied"] and "after_forward" not in clock["applied"]
        for variant in ("l2first", "shared", "readers"):
            assert results(f"{variant}-dear", rank)["touches"] > 0, variant
    assert results("rankzero-dear", 0)["touches"] > 0 and results("rankzero-dear", 1)["touches"] == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_collective_order_is_the_same_on_every_rank(results, variant):
    """Rank 0 alone makes gradients whole (its callback reads them); the collectives still go in one order."""
    traces = [per_link(results(f"{variant}-dear", rank)["trace"]) for rank in (0, 1)]
    assert traces[0] == traces[1]
