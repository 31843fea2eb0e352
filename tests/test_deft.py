"""DeFT in real 2-process Lightning runs: no delay == ddp, a forced delayed plan (compensated or not) ==
a single-process replay of the same merges and staleness, resume == uninterrupted, hand-overs to
DeAR and WFBP, the Preserver's decisions, and refusals."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from commsched.deft.plan import DeFTPlan
from commsched.deft.stability import Stepper, largest_stable_curvature
from conftest import WORKERS, max_abs_diff, per_link, run_worker
from deft_replay import replay


def test_deft_without_delay_equals_ddp(cases):
    results = cases(2)
    for case, reference in (("deft-sgd", "ddp-sgd"), ("deft-adamw", "ddp-adamw"), ("deft-value", "ddp-value")):
        diff, key = max_abs_diff(results.load(reference)["state"], results.load(case)["state"])
        assert diff <= 1e-5, f"{case} vs {reference}: {diff} at {key}"
        ranks = results.all_ranks(case)
        assert per_link(ranks[0]["trace"]) == per_link(ranks[1]["trace"])
        # the plan's own replay ran every step (fallback="never": no hand-over), its sends tagged g<gen>.b<bucket>
        sends = [record for record in ranks[0]["trace"] if GRADIENT_TAG.match(record[2])]
        assert len(sends) >= ranks[0]["global_step"], f"{case}: {len(sends)} sends in {ranks[0]['global_step']} steps"
        assert not any(record[2].startswith("bucket") for record in ranks[0]["trace"]), f"{case}: handed to WFBP"


GRADIENT_TAG = re.compile(r"g\d+\.b\d+")


def test_an_undelayed_plan_over_both_links_equals_sync_sgd(deft_runs):
    """Gradients themselves cross the secondary (not only the timing all-reduces), and nothing is delayed."""
    result = deft_runs("undelayed-two-links")
    plan = DeFTPlan.from_json(result["plan"])
    assert not plan.delayed
    sent = [record for record in per_link(result["trace"]).get("secondary", []) if GRADIENT_TAG.match(record[2])]
    assert sent, "no gradient crossed the secondary link"
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5


def test_deft_keeps_replicas_identical_when_parameters_are_unfrozen(cases):
    results = cases(3)
    ranks = results.all_ranks("deft-unfreeze")
    for other in ranks[1:]:
        assert max_abs_diff(ranks[0]["state"], other["state"])[0] == 0.0
    assert max_abs_diff(ranks[0]["state"], results.load("wfbp-unfreeze")["state"])[0] <= 1e-5


@pytest.fixture(scope="module")
def deft_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deft")
    proc = run_worker(
        "run_deft.py",
        str(out),
        "2",
        "forced-sgd",
        "forced-adamw",
        "forced-sgd-part",
        "forced-sgd-resumed",
        "forced-spike",
        "forced-spike-part",
        "forced-spike-resumed",
        "forced-predict",
        "forced-both",
        "forced-both-part",
        "forced-both-resumed",
        "preserved",
        "preserved-stale",
        "preserved-auto",
        "rechecked",
        "profiled",
        "handed-sgd",
        "handed-sgd-part",
        "handed-sgd-resumed",
        "handed-two-links",
        "handed-wfbp",
        "confirmed-dear",
        "confirmed-delayed",
        "undelayed-two-links",
    )
    if proc.returncode != 0:
        pytest.fail(f"deft runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    load = lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.out = out
    return load


@pytest.mark.parametrize("case", ["forced-sgd", "forced-adamw"])
def test_forced_delays_equal_a_single_process_replay(deft_runs, case):
    result = deft_runs(case)
    plan = DeFTPlan.from_json(result["plan"])
    assert plan.delayed and max(plan.k) > 1, plan.describe()
    expected = replay(result)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    other = deft_runs(case, 1)
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    assert {"primary", "secondary"} <= set(per_link(result["trace"]))


def test_spike_compensated_delays_equal_a_single_process_replay(deft_runs):
    """compensation="spike", two param groups with their own momentum and decay: the product equals
    the replay's written-out compensated SGD, not the uncompensated trajectory."""
    result = deft_runs("forced-spike")
    plan = DeFTPlan.from_json(result["plan"])
    assert plan.delayed and max(plan.k) > 1, plan.describe()
    diff, key = max_abs_diff(replay(result, compensation="spike"), result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(replay(result), result["state"])[0] > 1e-3
    assert max_abs_diff(result["state"], deft_runs("forced-spike", 1)["state"])[0] == 0.0


def test_step_hooks_see_the_users_settings_and_the_compensated_step_whole(deft_runs):
    """Spike compensation steps the SGD with gradients and decay scaled by m^D, then adds the share the
    late gradients missed: torch's global step hooks see neither, as under ddp they see one step. A
    pre-hook reads the decay the user set; a post-hook reads the weights the next pre-hook finds. The
    generations still in flight when training ends are drained as steps of their own, hooks around each:
    the last post-hook reads the final weights."""
    result = deft_runs("forced-spike")
    pre = [call for call in result["hooks"] if call[0] == "pre"]
    post = [call for call in result["hooks"] if call[0] == "post"]
    assert len(pre) == len(post) > result["steps"]
    assert post[-1][2] == pytest.approx(sum(float(v.double().sum()) for v in result["state"].values()), abs=1e-6)
    assert {decay for _, decay, _ in pre + post} == {0.05}
    for i, (after, next_before) in enumerate(zip(post, pre[1:])):
        assert after[2] == pytest.approx(next_before[2], abs=1e-6), (
            f"step {i}: the post-hook saw weights before the step was whole"
        )


@pytest.mark.parametrize("case, compensation", [("forced-predict", "predict"), ("forced-both", "spike+predict")])
def test_predicted_weights_equal_a_single_process_replay(deft_runs, case, compensation):
    """Linear weight prediction under AdamW, and with spike compensation under SGD: the product equals
    the replay's gradients taken at the extrapolated weights, not the trajectory without them."""
    result = deft_runs(case)
    diff, key = max_abs_diff(replay(result, compensation=compensation), result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    without = compensation.removesuffix("predict").removesuffix("+") or "none"
    assert max_abs_diff(replay(result, compensation=without), result["state"])[0] > 1e-3
    assert max_abs_diff(result["state"], deft_runs(case, 1)["state"])[0] == 0.0


@pytest.mark.parametrize("case", ["forced-spike", "forced-both"])
def test_resumed_with_compensated_generations_in_flight_equals_uninterrupted(deft_runs, case):
    for rank in (0, 1):
        whole, resumed = deft_runs(case, rank), deft_runs(f"{case}-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] <= 1e-6


def test_resumed_with_delayed_gradients_equals_uninterrupted(deft_runs):
    for rank in (0, 1):
        whole, resumed = deft_runs("forced-sgd", rank), deft_runs("forced-sgd-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] <= 1e-6


def test_an_undelayed_plan_handed_to_dear_equals_sync_sgd_and_resumes_exactly(deft_runs):
    """dear_fallback="when_undelayed": after the measured steps DeAR's hooks run the iterations."""
    result, other = deft_runs("handed-sgd"), deft_runs("handed-sgd", 1)
    assert result["report"]["runs"] == "dear" and not DeFTPlan.from_json(result["plan"]).delayed
    assert {"wfbp_ms", "dear_ms"} <= set(result["report"]["predicted"])
    collectives = {(link, collective) for link, collective, *_ in result["trace"]}
    assert {("primary", "reduce_scatter"), ("primary", "all_gather")} <= collectives
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    for rank in (0, 1):
        resumed = deft_runs("handed-sgd-resumed", rank)
        assert resumed["report"]["runs"] == "dear"
        assert max_abs_diff(deft_runs("handed-sgd", rank)["state"], resumed["state"])[0] <= 1e-6


def test_dear_over_both_links_equals_sync_training(deft_runs):
    """Halves from the timings file: DeAR over both links is predicted fastest and runs, exactly."""
    result, other = deft_runs("handed-two-links"), deft_runs("handed-two-links", 1)
    assert result["report"]["runs"] == "dear" and set(result["report"]["dear_links"]) == {"primary", "secondary"}
    collectives = {(link, collective) for link, collective, *_ in result["trace"]}
    assert {(link, op) for link in ("primary", "secondary") for op in ("reduce_scatter", "all_gather")} <= collectives
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_ddps_schedule_is_handed_to_wfbp_when_dear_is_slower(deft_runs):
    """A callback reads the weights every step: DeAR is still considered (it is exact under any callback)
    and, predicted slower here, DDP's schedule goes to WFBP."""
    result, other = deft_runs("handed-wfbp"), deft_runs("handed-wfbp", 1)
    assert result["report"]["runs"] == "wfbp"
    assert result["report"]["predicted"]["dear_ms"] > result["report"]["predicted"]["wfbp_ms"]
    after_decision = [op for link, op, tag, *_ in result["trace"] if link == "primary" and tag.startswith("bucket")]
    assert after_decision and set(after_decision) == {"all_reduce"}
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_real_steps_overrule_a_wrong_prediction(deft_runs):
    """Predicted slower, DeAR is timed on real steps against WFBP, whose steps a callback slows down by
    0.3 s: the measurement wins, every rank agrees, and the switches keep training exact."""
    result, other = deft_runs("confirmed-dear"), deft_runs("confirmed-dear", 1)
    report = result["report"]
    assert report["predicted"]["dear_ms"] > report["predicted"]["wfbp_ms"]
    assert report["runs"] == "dear" and report == other["report"]
    assert report["measured"]["wfbp"] > report["measured"]["dear"] + 250, report["measured"]
    reduce_scatters = [tag for link, op, tag, *_ in result["trace"] if op == "reduce_scatter"]
    assert reduce_scatters, "DeAR never ran"
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_a_delayed_plan_taking_turns_with_wfbp_comes_back_with_nothing_in_flight(deft_runs):
    """The confirmation hands the iterations to WFBP on the primary (always a candidate; DeAR's halves
    are slow here) and back twice: each time the plan's generations in flight step before WFBP runs,
    and the plan's replay starts again from its first iteration (it used to continue where it had
    stopped, and sent a generation no iteration had joined)."""
    result, other = deft_runs("confirmed-delayed"), deft_runs("confirmed-delayed", 1)
    assert DeFTPlan.from_json(result["plan"]).delayed
    assert result["report"]["predicted"]["wfbp_ms"] < result["report"]["predicted"]["dear_ms"]
    assert set(result["report"]["measured"]) == {"plan", "wfbp"} and result["report"] == other["report"]
    wfbps_turns = [tag for link, op, tag, *_ in result["trace"] if op == "all_reduce" and tag.startswith("bucket")]
    assert wfbps_turns, "WFBP never ran"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_preserver_decides_and_logs_every_decision(deft_runs):
    decisions = deft_runs("preserved")["decisions"]
    assert decisions and decisions[-1]["accepted"]
    for d in decisions:
        assert set(d) >= {"ratio", "k", "capacity", "accepted"}
    for earlier, later in zip(decisions, decisions[1:]):
        assert not earlier["accepted"]
        assert later["capacity"] is None or later["capacity"] > earlier["capacity"]
    accepted = decisions[-1]
    assert accepted["capacity"] is None or abs(accepted["ratio"] - 1) <= 0.01
    assert accepted["staleness"] == 0  # max_staleness=0
    # The forced timings make the first plan (capacity 1.0, as forced-sgd runs it) delay: the guard
    # must reject it, for a reason it states, before it accepts a larger capacity.
    first = decisions[0]
    assert len(decisions) >= 2 and not first["accepted"] and first["capacity"] == 1.0
    assert abs(first["ratio"] - 1) > 0.01 or first["staleness"] > 0


def test_preserver_judges_stale_plans_by_the_measured_curvature(deft_runs):
    """max_staleness=1: a stale plan is accepted only while the optimizer with that staleness stays
    stable on the top curvature measured on the probe steps (agreed by every rank)."""
    runs = [deft_runs("preserved-stale", r) for r in (0, 1)]
    ranks = [run["decisions"] for run in runs]  # rank 0 solves, every rank replays what it broadcast
    stale = [d for d in ranks[0] if d["staleness"] == 1]
    assert stale, "the forced timings make the first plans stale"
    for d in stale:
        assert d["curvature"] > 0 and d["stable_below"] > 0 and d["margin"] == 1.0
        assert d["accepted"] == (abs(d["ratio"] - 1) <= 0.01 and d["curvature"] < d["stable_below"])
    # the band is the optimizer's as it is at the decision (SGD, momentum 0.9, lr 0.2 decaying by 1/(1 + 0.05 step)):
    # (1 - m) / lr
    assert (
        largest_stable_curvature(Stepper(0.2, 0.9), 1)
        <= stale[0]["stable_below"]
        <= largest_stable_curvature(Stepper(0.15, 0.9), 1)
    )
    assert [d for d in ranks[0] if d["staleness"] > 1 and d["accepted"]] == []
    assert runs[0]["plan"] == runs[1]["plan"] and max_abs_diff(runs[0]["state"], runs[1]["state"])[0] == 0.0


def test_preserver_with_one_step_allowed_accepts_a_compensated_stale_plan(deft_runs):
    """max_staleness=1 and the compensation's default ("auto"): under SGD with momentum 0.9 a
    one-step-stale plan is accepted because it runs with spike compensation and weight prediction,
    measured to keep accuracy one step late; the run equals the replay's written-out compensated SGD."""
    result = deft_runs("preserved-auto")
    accepted = [d for d in result["decisions"] if d["accepted"]]
    assert len(accepted) == 1 and accepted[0]["staleness"] == 1, result["decisions"]
    assert accepted[0]["compensation"] == "spike+predict" and accepted[0]["measured_staleness"] == 1
    assert result["report"]["compensation"] == "spike+predict" and result["report"]["runs"] == "plan"
    diff, key = max_abs_diff(replay(result, compensation="spike+predict"), result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(replay(result), result["state"])[0] > 1e-3
    assert max_abs_diff(result["state"], deft_runs("preserved-auto", 1)["state"])[0] == 0.0


def test_preserver_rechecks_and_the_engine_solves_again(deft_runs):
    ranks = [deft_runs("rechecked", r) for r in (0, 1)]
    decisions = ranks[0]["decisions"]
    assert sum(d["accepted"] for d in decisions) == 2  # at the start, and again at step 8
    assert max_abs_diff(ranks[0]["state"], ranks[1]["state"])[0] == 0.0
    assert per_link(ranks[0]["trace"]) == per_link(ranks[1]["trace"])


def test_profiled_run_traces_one_lane_per_link(deft_runs):
    trace = json.loads((deft_runs.out / "profiled-profile" / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"link: primary", "link: secondary"} <= lanes
    busy = {e["tid"] for e in events if e.get("ph") == "X" and e["name"].startswith("all_reduce g")}
    assert len(busy) >= 2  # delayed generations went over both links while profiled


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-nesterov"])
def test_spike_compensation_is_refused_where_it_does_not_stand_in_for_the_momentum(optimizer, tmp_path):
    import lightning.pytorch as pl

    import commsched

    sys.path.insert(0, str(WORKERS))
    from run_deft import MLP

    strategy = commsched.DeFTStrategy(deft=commsched.DeFTOptions(compensation="spike"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    environment = dict(os.environ)
    try:
        with pytest.raises(
            commsched.CommSchedConfigError,
            match=r"compensation='spike'.*(AdamW|SGD).*Allowed values of compensation: auto, none, spike",
        ):
            trainer.fit(MLP(optimizer))
    finally:  # the one-process group holds MASTER_PORT, which every later worker of the suite would inherit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
