"""DeFT's communication state: what a checkpoint holds of the schedule, and its restore.

Kept beside the schedule (it reads the schedule's parts): the plan and the decisions around it, the
optimizer steps taken, the watch's progress and snapshot (shared: the same on every rank), and per
rank the generations in flight, the stage times and probes being measured, the weight prediction and
the watch's losses. A resumed run then replays, measures and judges as the uninterrupted one.
`deft` below is the `DeFTSchedule` (not imported: the schedules import this folder).
"""

from __future__ import annotations

from typing import Any

from commsched.deft.generations import same_layout
from commsched.deft.iteration_model import ScheduleChoice
from commsched.deft.plan import DeFTPlan, no_delay_plan
from commsched.state import refuse_unknown

KEYS = (
    "deft_plan",
    "decided",
    "iteration",
    "seen",
    "decisions",
    "choice",
    "bucket_numels",
    "generations",
    "meter",
    "projections",
    "confirmed",
    "updates",
    "prediction",
    "watch",
    "watch_rank",
    "replan_at",
)


def saved_state(deft: Any) -> dict[str, Any]:
    measuring_again = (
        deft.replan_requested
    )  # asked to solve again: what is carried over starts measuring, as `_restart_measuring` does
    plan = no_delay_plan(deft.whole_buckets()) if measuring_again else deft.deft_plan
    return {
        "shared": {
            "deft_plan": plan.to_json(),
            "decided": deft.decided and not measuring_again,
            "iteration": 0 if measuring_again else deft.iteration,
            "seen": deft.options.warmup_steps if measuring_again else deft.seen,
            "decisions": deft.decisions,
            "choice": (ScheduleChoice("plan") if measuring_again else deft.choice).to_json(),
            "confirmed": deft.confirmation is None,
            "updates": deft.updates,
            "watch": deft.watch.shared_state(restarting=measuring_again),
            "replan_at": None if measuring_again else deft.replan_at,
            "bucket_numels": [b.buffer.numel() for b in deft.plan.buckets],
        },
        "per_rank": {
            "generations": deft.in_flight.state(),
            "meter": deft.meter.state(),
            "projections": [list(p) for p in deft.probes.projections],
            "prediction": deft.compensator.state(),
            "watch_rank": deft.watch.rank_state(restarting=measuring_again),
        },
    }


def load_saved_state(deft: Any, state: dict[str, Any]) -> None:
    """The merged shared and per-rank state (empty: nothing saved; another bucket layout: measure again)."""
    refuse_unknown(deft.name, state, KEYS)
    deft.watch.load_run(state.get("watch", {}))  # a stop refuses stale plans for the run, whatever the buckets
    if not state or not same_layout(state, deft.plan, quiet=deft.settling):
        return
    deft.deft_plan, deft.decided = DeFTPlan.from_json(state["deft_plan"]), state["decided"]
    deft.iteration, deft.seen = state["iteration"], state["seen"]
    deft.updates = state.get("updates", 0)
    deft.replan_at = state.get("replan_at")
    deft.decisions = list(state.get("decisions", []))
    deft.choice = ScheduleChoice.from_json(state.get("choice", {"runs": "plan"}))
    if deft.decided and not state.get("confirmed", True):
        deft.confirm_later()  # saved while timing the candidates: time them again
    deft.in_flight.restore(state.get("generations", []))
    deft.meter.load(state["meter"])
    deft.probes.projections = [list(p) for p in state.get("projections", [])]
    deft.compensator.load(state.get("prediction", {}))
    deft.watch.load({**state.get("watch", {}), **state.get("watch_rank", {})})
