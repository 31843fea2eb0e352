"""The optimizer's contract under every schedule: the step hooks users register (the optimizer's
own pre/post hooks and torch's global ones; EMA, schedule-free and logging libraries hook there)
run once per optimizer step, with the param groups the user built, seeing the weights ddp would
show them, however the schedule applies the update inside the step (DeAR: bucket by bucket)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_worker

SCHEDULES = ["ddp", "wfbp", "dear", "topk"]


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("optimizer_hooks")
    proc = run_worker("run_optimizer_hooks.py", str(out), *SCHEDULES)
    if proc.returncode != 0:
        pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    calls = {(s, r): json.loads((out / f"{s}.rank{r}.json").read_text()) for s in SCHEDULES for r in (0, 1)}
    calls["checkpoints"] = {
        s: torch.load(next((out / f"{s}-ckpt").glob("*.ckpt")), weights_only=False) for s in ("ddp", "topk")
    }
    return calls


def test_under_ddp_each_hook_runs_once_a_step_with_every_parameter(calls):
    """The reference itself: 6 steps, the four hooks once each, all 6 parameters in the one group."""
    kinds = [kind for kind, *_ in calls[("ddp", 0)]]
    assert kinds == ["global pre", "pre", "post", "global post"] * 6
    assert all(groups == [6] and terms == [0.9, 1e-3] for _, groups, _, terms in calls[("ddp", 0)])


@pytest.mark.parametrize("schedule", ["wfbp", "dear", "topk"])
def test_the_hooks_run_as_under_ddp(calls, schedule):
    """topk: DGC's corrections step the SGD with momentum and weight decay 0, which no hook sees."""
    for rank in (0, 1):
        seen, reference = calls[(schedule, rank)], calls[("ddp", rank)]
        assert [(kind, groups, terms) for kind, groups, _, terms in seen] == [
            (kind, groups, terms) for kind, groups, _, terms in reference
        ]
        for i, ((kind, _, weights, _), (_, _, expected, _)) in enumerate(zip(seen, reference)):
            assert weights == pytest.approx(expected, abs=1e-5), f"call {i} ({kind}) read other weights than under ddp"


def test_a_topk_checkpoint_holds_the_momentum_ddp_would_resume_with(calls):
    """DGC keeps the momentum in each rank's velocity, outside the SGD (which steps with momentum 0): the
    checkpoint's optimizer state holds it as `momentum_buffer`, equal to ddp's after the same steps."""
    ddp, topk = (calls["checkpoints"][s]["optimizer_states"][0]["state"] for s in ("ddp", "topk"))
    assert set(ddp) == set(topk) and len(ddp) == 6
    for index, expected in ddp.items():
        got = topk[index]["momentum_buffer"]
        assert got.abs().sum() > 0
        assert (got - expected["momentum_buffer"]).abs().max() <= 1e-5, f"parameter {index}"
