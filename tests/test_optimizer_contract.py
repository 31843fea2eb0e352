"""The optimizer's contract under every schedule: the step hooks users register (the optimizer's
own pre/post hooks and torch's global ones; EMA, schedule-free and logging libraries hook there)
run once per optimizer step, with the param groups the user built, seeing the weights ddp would
show them, however the schedule applies the update inside the step (DeAR: bucket by bucket)."""

from __future__ import annotations

import json

import pytest

from conftest import run_worker

SCHEDULES = ["ddp", "wfbp", "dear"]


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("optimizer_hooks")
    proc = run_worker("run_optimizer_hooks.py", str(out), *SCHEDULES)
    if proc.returncode != 0:
        pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {(s, r): json.loads((out / f"{s}.rank{r}.json").read_text()) for s in SCHEDULES for r in (0, 1)}


def test_under_ddp_each_hook_runs_once_a_step_with_every_parameter(calls):
    """The reference itself: 6 steps, the four hooks once each, all 6 parameters in the one group."""
    kinds = [kind for kind, _, _ in calls[("ddp", 0)]]
    assert kinds == ["global pre", "pre", "post", "global post"] * 6
    assert all(groups == [6] for _, groups, _ in calls[("ddp", 0)])


@pytest.mark.parametrize("schedule", ["wfbp", "dear"])
def test_the_hooks_run_as_under_ddp(calls, schedule):
    for rank in (0, 1):
        seen, reference = calls[(schedule, rank)], calls[("ddp", rank)]
        assert [(kind, groups) for kind, groups, _ in seen] == [(kind, groups) for kind, groups, _ in reference]
        for i, ((kind, _, weights), (_, _, expected)) in enumerate(zip(seen, reference)):
            assert weights == pytest.approx(expected, abs=1e-5), f"call {i} ({kind}) read other weights than under ddp"
