"""DeFT's decision once its measured steps are over: every rank agrees on the measurements, rank 0
solves the plan (the Preserver may enlarge its capacity) and chooses what runs the iterations
(`iteration_model.choose_schedule`), every rank adopts the same decision and checks its hash."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_warn

from commsched.comm.buckets import BucketPlan
from commsched.comm.links import Link
from commsched.deft.iteration_model import ScheduleChoice, choose_schedule
from commsched.deft.measure import (
    StageMeter,
    agreed_stage_times,
    all_reduce_seconds,
    halves_seconds,
    load_halves,
    load_timings,
)
from commsched.deft.plan import DeFTPlan, Timings, plan_for
from commsched.deft.probes import GradientProbes
from commsched.errors import ScheduleError
from commsched.options import DeFTOptions
from commsched.say import say

Halves = tuple[list[list[float]], list[list[float]]]


@dataclass
class Decision:
    plan: DeFTPlan
    timings: Timings
    choice: ScheduleChoice
    preserver: list[dict[str, Any]] = field(default_factory=list)
    """The Preserver's decisions, one per plan it judged."""


def decide_plan(
    plan: BucketPlan,
    links: list[Link],
    control: Link,
    options: DeFTOptions,
    preserver: Any,
    meter: StageMeter,
    probes: GradientProbes,
    compensation: str = "none",
    measured_staleness: int = 0,
    stale_barred: Optional[str] = None,
    stale_wait_until: Optional[int] = None,
) -> Decision:
    """Every rank calls it at the same iteration boundary (it issues collectives on every link).
    `compensation` is the one that runs, and `measured_staleness` how late it was measured to keep
    this optimizer's accuracy (`deft.compensation`): the Preserver judges stale plans by them.
    `stale_barred`: why the Preserver takes no stale plan now (the watch stopped one, or it is too early:
    `stale_wait_until` the step it may from; the decisions it rejects only for that say "waiting")."""
    forward, backward = agreed_stage_times(*meter.per_bucket_backward(len(plan.buckets)), control)
    shared = False
    if options.timings_file is not None:
        timings = load_timings(options.timings_file, len(plan.buckets))
    else:
        costs, shared = all_reduce_seconds(plan, links, control, options.cost_repeats)
        timings = Timings(forward, backward, costs)
        if shared:
            say(
                "commsched deft: the secondary link shares the primary's network (each slows the other "
                "down): only the primary is used"
            )
    stats = {
        **probes.walk_statistics(preserver),
        "compensation": compensation,
        "measured_staleness": measured_staleness,
        "stale_barred": stale_barred,
        "stale_wait_until": stale_wait_until,
    }
    halves = _dear_halves(plan, links, control, options, shared)
    mine = _solve(plan, timings, stats, halves, options, preserver) if control.rank == 0 else None
    decided = control.broadcast_object(mine, src=0, tag="deft-plan")
    decision = Decision(
        DeFTPlan.from_json(decided["plan"]), timings, ScheduleChoice.from_json(decided["choice"]), decided["preserver"]
    )
    _check_same_plan(decision.plan, control)
    if preserver is None and decision.plan.delayed and decision.choice.runs == "plan":
        rank_zero_warn(
            f"commsched deft: running a delayed plan without the Preserver ({decision.plan.describe()}): "
            "delayed and stale updates can cost accuracy (one iteration of staleness cost 25 points on the "
            "digits run of docs/deft.md) and nothing checks it. Leave the Preserver on (PreserverOptions(), "
            "preserver.enabled=true) or set deft.capacity=None for no delay."
        )
    compensated = ""
    if decision.plan.staleness and decision.choice.runs == "plan":
        compensated = (
            f"; late generations compensated by {compensation}"
            if compensation != "none"
            else "; late generations uncompensated"
        )
    say(
        f"commsched deft: {decision.plan.describe()}{compensated}; mu = c_secondary/c_primary = {timings.mu:.2f}; "
        f"T_F {timings.forward * 1e3:.1f} ms, T_B {sum(timings.backward) * 1e3:.1f} ms, all-reduce "
        f"{sum(timings.costs[0]) * 1e3:.1f} ms primary / {sum(timings.costs[1]) * 1e3:.1f} ms secondary; "
        f"{describe_decision(decision.choice, options.fallback, control.world_size)}"
    )
    return decision


def _dear_halves(
    plan: BucketPlan, links: list[Link], control: Link, options: DeFTOptions, shared: bool
) -> Optional[Halves]:
    """DeAR's reduce-scatter and all-gather times per link and bucket (None: DeAR may not run): from
    the timings file, or timed on every link (the primary alone on a shared wire, where a second
    group gains DeAR nothing either)."""
    if options.fallback == "never" or control.world_size == 1:
        return None
    if options.timings_file is not None:
        return load_halves(options.timings_file, len(plan.buckets))
    measured = [halves_seconds(plan, link, control, options.cost_repeats) for link in (links[:1] if shared else links)]
    return [rs for rs, _ in measured], [ag for _, ag in measured]


def _solve(
    plan: BucketPlan,
    timings: Timings,
    stats: dict[str, float],
    halves: Optional[Halves],
    options: DeFTOptions,
    preserver: Any,
) -> dict[str, Any]:
    numels = [b.buffer.numel() for b in plan.buckets]

    def solve(capacity: Optional[float]) -> DeFTPlan:
        return plan_for(numels, timings, math.inf if capacity is None else capacity)

    if preserver is not None:
        solved, decisions = preserver.choose(solve, options.capacity, stats)
    else:
        solved, decisions = solve(options.capacity), []
    choice = choose_schedule(solved, timings, numels, options.fallback, halves)
    return {"plan": solved.to_json(), "preserver": decisions, "choice": choice.to_json()}


def _check_same_plan(plan: DeFTPlan, control: Link) -> None:
    digests = control.all_gather_int(int(plan.digest(), 16) % (2**62), "deft-plan-hash")
    if len(set(digests)) != 1:
        raise ScheduleError(f"commsched deft: ranks replay different plans (hashes {digests})")


NAMES = {"wfbp": "WFBP", "dear": "DeAR", "plan": "the plan"}


def describe_decision(choice: ScheduleChoice, fallback: str, world_size: int) -> str:
    """What runs the iterations, and why: the fallback setting and the predictions it compared."""
    if choice.predicted:
        compared = "predicted " + ", ".join(
            f"{name} {choice.predicted[f'{runs}_ms']:.0f} ms"
            for runs, name in NAMES.items()
            if f"{runs}_ms" in choice.predicted
        )
        if choice.measured:
            compared += "; measured " + ", ".join(f"{NAMES[runs]} {ms:.0f} ms" for runs, ms in choice.measured.items())
    else:
        compared = "DeAR not considered: " + (
            "deft.fallback=never" if fallback == "never" else "one process" if world_size == 1 else "no DeAR timings"
        )
    if choice.runs == "dear":
        return f"run by DeAR over {'+'.join(sorted(set(choice.dear_links)))} (deft.fallback={fallback}: {compared})"
    if choice.runs == "wfbp":
        return f"run by WFBP on the primary (deft.fallback={fallback}: {compared})"
    reason = "deft.fallback=never" if fallback == "never" else f"deft.fallback={fallback}: {compared}"
    return f"run by the plan ({reason})"


def report(
    plan: DeFTPlan,
    choice: ScheduleChoice,
    decided: bool,
    options: DeFTOptions,
    world_size: int,
    timings: Optional[Timings],
    decisions: list[dict[str, Any]],
    compensation: str = "none",
    watch: Optional[list[str]] = None,
    stale_refused: bool = False,
) -> dict[str, Any]:
    """What was decided, for metrics files and benchmark tables."""
    described = plan.describe() + (f"; {describe_decision(choice, options.fallback, world_size)}" if decided else "")
    return {
        "plan": described,
        "n": plan.n,
        "k": list(plan.k),
        "compensation": compensation,
        "staleness": plan.staleness,
        "runs": choice.runs,
        "dear_links": list(choice.dear_links),
        "predicted": choice.predicted,
        "measured": choice.measured,
        "mu": timings.mu if timings is not None else None,
        "preserver": decisions,
        "watch": list(watch or []),
        "stale_refused": stale_refused,
    }
