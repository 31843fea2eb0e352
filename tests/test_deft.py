"""DeFT in real 2-process Lightning runs: no delay == ddp, a forced delayed plan (compensated or not) ==
a single-process replay of the same merges and staleness, resume == uninterrupted, hand-overs to
DeAR and WFBP, the Preserver's decisions, and refusals."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from commsched.deft.plan import DeFTPlan
from commsched.deft.stability import Stepper, largest_stable_curvature
from conftest import WORKERS, max_abs_diff, per_link, run_worker


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
    proc = run_worker("run_deft.py", str(out), "2", "forced-sgd", "forced-adamw", "forced-sgd-part", "forced-sgd-resumed",
                      "forced-spike", "forced-spike-part", "forced-spike-resumed", "forced-predict", "forced-both",
                      "forced-both-part", "forced-both-resumed", "preserved", "preserved-stale", "preserved-auto",
                      "rechecked", "profiled", "handed-sgd", "handed-sgd-part", "handed-sgd-resumed", "handed-two-links",
                      "handed-wfbp", "confirmed-dear", "confirmed-delayed", "undelayed-two-links", "watched-kept",
                      "watched-stopped", "watched-drained", "watched-stopped-part", "watched-stopped-resumed",
                      "watched-stopped-late-part", "watched-stopped-late-resumed", "watched-drained-late-part",
                      "watched-drained-late-resumed", "watched-rechecked")
    if proc.returncode != 0:
        pytest.fail(f"deft runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    load = lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.out = out
    return load


def replay(result: dict, compensation: str = "none", watch: Optional[tuple[int, bool]] = None) -> Any:
    """One process, every rank's gradient recomputed: the plan's merges, staleness and steps. With
    compensation "spike", SGD's step is written out here: a generation D optimizer steps late (steps
    taken since its newest gradient) moves the weights by lr (v + a d) with v <- m v + b d, d its gradient
    plus weight decay, a = (1 - m^D) / (1 - m), b = m^D. With "predict", each planned iteration's
    gradients are taken at w + D (w - w_before_last_step), D the optimizer steps until its generation
    steps; "spike+predict": both.

    `watch` = (window, rollback[, re-checked every n steps]): which plan ran each batch is read from the run's history (plans solved
    again after a stop or a re-check); the verdicts are the replay's own: after `window` iterations of a
    stale plan, it is stopped unless the mean loss over them (every rank's batch) is below that of the
    up to `window` iterations before it, since measuring last (re)started. Stopped: back to the state at
    its start (rollback: weights, velocity, optimizer state but not its learning rate; its generations
    dropped) or its generations applied in order, and no stale plan is watched again. A re-check solves
    again (in flight applied) and wins over a verdict due at the same step. Returns (state, verdicts)."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data, make_optimizer

    world, model = result["world"], MLP(result["optimizer"])
    model.load_state_dict(result["initial"])
    configured = make_optimizer(result["optimizer"], model.parameters())
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    x, y = data().tensors
    params = list(model.parameters())
    plan = DeFTPlan.from_json(result["plan"])

    # Lightning's DistributedSampler for training: shuffled, seeded by seed_everything, epoch 0
    shares = []
    for r in range(world):
        sampler = DistributedSampler(data(), num_replicas=world, rank=r, shuffle=True, seed=result["seed"])
        sampler.set_epoch(0)
        shares.append(list(sampler))

    losses: list[float] = []

    def averaged_gradient(t: int) -> list[torch.Tensor]:
        total, loss = [torch.zeros_like(p) for p in params], 0.0
        for r in range(world):
            idx = shares[r][t * BATCH:(t + 1) * BATCH]
            rank_loss = F.cross_entropy(model(x[idx]), y[idx])
            grads = torch.autograd.grad(rank_loss, params)
            total = [a + g / world for a, g in zip(total, grads)]
            loss += float(rank_loss.detach()) / world
        losses.append(loss)
        return total

    def what_runs(t: int) -> tuple[Optional[DeFTPlan], int]:
        """(the plan and its replay index, or None for a synchronous step) at batch t."""
        if watch is None:
            return (None, 0) if t < result["sync_steps"] else (plan, t - result["sync_steps"])
        _, index, solved = result["history"][t]
        return (None, 0) if index is None else (DeFTPlan.from_json(solved), index)

    velocity: dict[int, torch.Tensor] = {}
    taken = 0  # optimizer steps so far
    joined_at: dict[int, int] = {}
    before_last_step = [p.detach().clone() for p in params]

    def late_by(running: DeFTPlan, i: int) -> int:
        """How late iteration i's gradient lands: its generation's position among the plan's optimizer steps."""
        events = [(j, number) for j in range(i + 2 * running.n + 8) for number in running.at(j).steps]
        applied = next(e for e, (_, number) in enumerate(events) if number == running.at(i).joins)
        return applied - sum(1 for j, _ in events if j < i)

    @torch.no_grad()
    def spike(gradient: list[torch.Tensor], late: int) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        for group in optimizer.param_groups:
            m, decay, lr = group["momentum"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                i = index[id(p)]
                d = gradient[i] + decay * p
                if m == 0:
                    p.sub_(lr * d)
                    continue
                a, b = (1 - m ** late) / (1 - m), m ** late
                velocity[i] = b * d if i not in velocity else m * velocity[i] + b * d
                p.sub_(lr * (velocity[i] + a * d))

    def step(gradient: list[torch.Tensor], late: int = 0) -> None:
        nonlocal taken, before_last_step
        before_last_step = [p.detach().clone() for p in params]
        if compensation.startswith("spike"):
            spike(gradient, late)
            optimizer._opt_called = True  # the step is written out here: the scheduler must not warn
        else:
            for p, g in zip(params, gradient):
                p.grad = g.clone()
            optimizer.step()
        taken += 1

    def apply_what_is_left() -> None:
        for number in sorted(generations):
            summed, k = generations.pop(number)
            step([g / k for g in summed], taken - joined_at[number])

    generations: dict[int, list] = {}
    watched_from, snapshot, verdicts, judged, refused = None, None, [], False, False
    measured_from = 0  # where measuring (re)started
    for t in range(result["steps"]):
        running, i = what_runs(t)
        rechecked = watch is not None and len(watch) > 2 and t > 0 and t % watch[2] == 0
        if rechecked:  # solved again (the Preserver's re-check): in flight is applied, the plan not judged
            apply_what_is_left()
            watched_from, judged, measured_from = None, False, t
        elif watch is not None and watched_from is not None and t == watched_from + watch[0]:
            before = losses[max(measured_from, watched_from - watch[0]):watched_from]
            after = sum(losses[watched_from:t]) / watch[0]
            stopped = not after < sum(before) / len(before)
            verdicts.append("stopped" if stopped else "kept")
            watched_from, judged, refused = None, True, refused or stopped
            if stopped and watch[1]:
                generations.clear()
                model.load_state_dict(snapshot[0])
                optimizer.load_state_dict({**optimizer.state_dict(), "state": snapshot[1]})  # its learning rate stays
                velocity.clear()
                velocity.update(snapshot[2])
                taken = snapshot[3]
            elif stopped:
                apply_what_is_left()
            if stopped:
                measured_from = t
        if watch is not None and not judged and not refused and running is not None and running.staleness and i == 0:
            watched_from = t
            snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()["state"]),
                        {k: v.clone() for k, v in velocity.items()}, taken)
        now = [p.detach().clone() for p in params]
        if compensation.endswith("predict") and running is not None:  # linear weight prediction
            with torch.no_grad():
                for p, w, before in zip(params, now, before_last_step):
                    p.copy_(w + late_by(running, i) * (w - before))
        gradient = averaged_gradient(t)
        with torch.no_grad():
            for p, w in zip(params, now):
                p.copy_(w)
        if running is None:
            step(gradient)
            scheduler.step()
            continue
        it = running.at(i)
        summed, k = generations.get(it.joins, ([torch.zeros_like(p) for p in params], 0))
        generations[it.joins] = ([a + g for a, g in zip(summed, gradient)], k + 1)
        joined_at[it.joins] = taken
        for number in it.steps:
            summed, k = generations.pop(number)
            step([g / k for g in summed], taken - joined_at[number])
            scheduler.step()
    apply_what_is_left()  # the end of training
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return (state, verdicts) if watch is not None else state


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
    assert set(result["report"]["predicted"]) == {"plan_ms", "dear_ms"}
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
    assert result["report"]["predicted"]["dear_ms"] > result["report"]["predicted"]["plan_ms"]
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
    assert report["predicted"]["dear_ms"] > report["predicted"]["plan_ms"]
    assert report["runs"] == "dear" and report == other["report"]
    assert report["measured"]["wfbp"] > report["measured"]["dear"] + 250, report["measured"]
    reduce_scatters = [tag for link, op, tag, *_ in result["trace"] if op == "reduce_scatter"]
    assert reduce_scatters, "DeAR never ran"
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_a_delayed_plan_taking_turns_with_dear_comes_back_with_nothing_in_flight(deft_runs):
    """The confirmation hands the iterations to DeAR and back twice: each time the plan's generations
    in flight step before DeAR runs, and the plan's replay starts again from its first iteration (it
    used to continue where it had stopped, and sent a generation no iteration had joined)."""
    result, other = deft_runs("confirmed-delayed"), deft_runs("confirmed-delayed", 1)
    assert DeFTPlan.from_json(result["plan"]).delayed
    assert set(result["report"]["measured"]) == {"plan", "dear"} and result["report"] == other["report"]
    reduce_scatters = [tag for link, op, tag, *_ in result["trace"] if op == "reduce_scatter"]
    assert reduce_scatters, "DeAR never ran"
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
    assert largest_stable_curvature(Stepper(0.2, 0.9), 1) <= stale[0]["stable_below"] <= largest_stable_curvature(Stepper(0.15, 0.9), 1)
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


@pytest.mark.parametrize("case, rollback, verdict", [("watched-kept", True, "kept"), ("watched-stopped", True, "stopped"),
                                                     ("watched-drained", False, "stopped")])
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
    assert indices[:result["sync_steps"]] == [None] * result["sync_steps"]
    if verdict == "kept":
        assert len(report["watch"]) == 1 and report["watch"][0].startswith("kept") and set(staleness) == {1}
    else:  # stale for the window, then measured again (synchronous steps), then exact
        stale_end = result["sync_steps"] + WATCH
        assert indices[result["sync_steps"]:stale_end] == list(range(WATCH)) and indices[stale_end] is None
        assert staleness[:WATCH] == [1] * WATCH and set(staleness[WATCH:]) == {0}
        assert len(report["watch"]) == 1 and report["watch"][0].startswith("stopped")
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    other = deft_runs(case, 1)
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    if verdict == "stopped":  # what the stop did matters: the other way of stopping ends elsewhere
        assert max_abs_diff(replay(result, compensation="spike+predict", watch=(WATCH, not rollback))[0], result["state"])[0] > 1e-3


@pytest.mark.parametrize("whole_case, resumed_case", [("watched-stopped", "watched-stopped-resumed"),
                                                      ("watched-stopped", "watched-stopped-late-resumed"),
                                                      ("watched-drained", "watched-drained-late-resumed")])
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
    expected, verdicts = replay(result, compensation="spike+predict", watch=(WATCH, True, 6))
    assert len(verdicts) == 1 and [v.split(":")[0] for v in result["report"]["watch"]] == verdicts
    indices = [index for _, index, _ in result["history"]]
    assert indices[3:9] == [0, 1, 2, None, None, 0]  # solved again as its window ended, then again stale
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(result["state"], deft_runs("watched-rechecked", 1)["state"])[0] == 0.0


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
    import commsched
    import lightning.pytorch as pl

    sys.path.insert(0, str(WORKERS))
    from run_deft import MLP

    strategy = commsched.DeFTStrategy(deft=commsched.DeFTOptions(compensation="spike"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    environment = dict(os.environ)
    try:
        with pytest.raises(commsched.CommSchedConfigError, match=r"compensation='spike'.*(AdamW|SGD).*Allowed values of compensation: auto, none, spike"):
            trainer.fit(MLP(optimizer))
    finally:  # the one-process group holds MASTER_PORT, which every later worker of the suite would inherit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
