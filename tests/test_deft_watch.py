"""The watch on DeFT's stale plans in real 2-process Lightning runs (tests/workers/run_deft.py): kept or
stopped (rolled back or not) as a single-process replay that judges on its own losses decides, resumed
inside its window or after it, re-checked, and a stale plan waiting for `stale_after_steps`."""

from __future__ import annotations

import sys

import pytest
import torch

from commsched.deft.plan import DeFTPlan
from conftest import WORKERS, max_abs_diff, per_link, run_worker
from deft_replay import replay

CASES = (
    "watched-kept",
    "watched-stopped",
    "watched-drained",
    "watched-stopped-part",
    "watched-stopped-resumed",
    "watched-stopped-late-part",
    "watched-stopped-late-resumed",
    "watched-drained-late-part",
    "watched-drained-late-resumed",
    "watched-rechecked",
    "watched-waiting",
    "watched-epoch",
)


@pytest.fixture(scope="module")
def deft_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("watched")
    proc = run_worker("run_deft.py", str(out), "2", *CASES)
    if proc.returncode != 0:
        pytest.fail(f"watched runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize(
    "case, rollback, verdict",
    [("watched-kept", True, "kept"), ("watched-stopped", True, "stopped"), ("watched-drained", False, "stopped")],
)
def test_the_watch_keeps_or_stops_a_stale_plan_as_a_single_process_replay_does(deft_runs, case, rollback, verdict):
    """A one-step-stale plan (spike+predict) watched for 3 iterations against the 3 synchronous ones
    before it. At lr 0.2 its loss falls and it runs on; at lr 1.0 it does not, and it is stopped: rolled
    back to its start (its iterations dropped) or with its delayed generations applied, then DeFT
    measures again and runs an exact plan. Both ranks end equal to the replay, which judges on its own losses."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import WATCH

    result = deft_runs(case)
    expected, judged = replay(result, compensation="spike+predict", watch=(WATCH, rollback))
    assert judged == [verdict]
    report = result["report"]
    assert report["stale_refused"] == (verdict == "stopped")
    indices = [index for _, index, _ in result["history"]]
    staleness = [DeFTPlan.from_json(solved).staleness for _, index, solved in result["history"] if index is not None]
    assert indices[: result["sync_steps"]] == [None] * result["sync_steps"]
    if verdict == "kept":
        assert len(report["watch"]) == 1 and report["watch"][0].startswith("kept") and set(staleness) == {1}
    else:  # stale for the window, then measured again (synchronous steps), then exact
        stale_end = result["sync_steps"] + WATCH
        assert indices[result["sync_steps"] : stale_end] == list(range(WATCH)) and indices[stale_end] is None
        assert staleness[:WATCH] == [1] * WATCH and set(staleness[WATCH:]) == {0}
        assert len(report["watch"]) == 1 and report["watch"][0].startswith("stopped")
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    other = deft_runs(case, 1)
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    if verdict == "stopped":  # what the stop did matters: the other way of stopping ends elsewhere
        assert (
            max_abs_diff(replay(result, compensation="spike+predict", watch=(WATCH, not rollback))[0], result["state"])[
                0
            ]
            > 1e-3
        )


@pytest.mark.parametrize(
    "whole_case, resumed_case",
    [
        ("watched-stopped", "watched-stopped-resumed"),
        ("watched-stopped", "watched-stopped-late-resumed"),
        ("watched-drained", "watched-drained-late-resumed"),
    ],
)
def test_resumed_inside_the_watch_decides_as_the_uninterrupted_run(deft_runs, whole_case, resumed_case):
    """Saved after 2 of the 3 watched iterations, or after the last (judged at the resumed run's first
    step, before its optimizer stepped): the losses (the verdict quotes both means), the snapshot and
    the refusal carry over, and what is in flight is dropped or applied as in the uninterrupted run."""
    for rank in (0, 1):
        whole, resumed = deft_runs(whole_case, rank), deft_runs(resumed_case, rank)
        assert resumed["report"]["stale_refused"] and resumed["report"]["watch"] == whole["report"]["watch"]
        assert max_abs_diff(whole["state"], resumed["state"])[0] <= 1e-6


def test_a_plan_solved_again_inside_its_window_is_not_judged(deft_runs):
    """The Preserver re-checks every 6 steps. At step 6 the first stale plan's window is over, and the
    re-check wins: it is not judged (its generations are applied, measuring starts again). The second
    is judged against the 2 iterations measured since, as the replay does."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import WATCH

    result = deft_runs("watched-rechecked")
    expected, verdicts = replay(result, compensation="spike+predict", watch=(WATCH, True, {6, 12}))
    assert len(verdicts) == 1 and [v.split(":")[0] for v in result["report"]["watch"]] == verdicts
    indices = [index for _, index, _ in result["history"]]
    assert indices[3:9] == [0, 1, 2, None, None, 0]  # solved again as its window ended, then again stale
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(result["state"], deft_runs("watched-rechecked", 1)["state"])[0] == 0.0


def test_a_stale_plan_waits_for_stale_after_steps(deft_runs):
    """stale_after_steps=6: at step 3 every stale plan is rejected as waiting and an exact one runs; at
    step 6 DeFT solves again, and the stale plan accepted then is watched, as the replay does."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import WATCH

    result = deft_runs("watched-waiting")
    waiting = [d for d in result["decisions"] if d.get("waiting")]
    assert waiting and all(d["staleness"] > 0 and not d["accepted"] for d in waiting)
    ran = [(index, DeFTPlan.from_json(solved).staleness) for _, index, solved in result["history"]]
    assert all(staleness == 0 for index, staleness in ran[:6]) and ran[6][0] is None
    assert any(index is not None and staleness == 1 for index, staleness in ran[6:])
    expected, verdicts = replay(result, compensation="spike+predict", watch=(WATCH, True, {6}))
    assert len(verdicts) == 1 and [v.split(":")[0] for v in result["report"]["watch"]] == verdicts
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    # by default a stale plan waits one epoch: 256 samples in batches of 4 over 2 ranks, 32 steps
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, SAMPLES

    epoch = deft_runs("watched-epoch")
    assert {d["waiting"] for d in epoch["decisions"] if "waiting" in d} == {True}
    one_epoch = SAMPLES // (2 * BATCH)  # 2 ranks
    assert epoch["report"]["staleness"] == 0
    assert all(
        f"wait until step {one_epoch} " in d["barred"] and "no stale plan will run" in d["barred"]
        for d in epoch["decisions"]
        if "waiting" in d
    )  # 6 steps: the run ends before the wait, and says so
