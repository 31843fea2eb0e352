"""Iteration times predicted from the measurements DeFT solves from: its plan replayed, and DeAR.

DeFT hides communication by delaying it; when the plan it may use delays nothing (the Preserver's
default allows no stale gradient) it can still gain by spreading buckets over two links, and on one
link each bucket is all-reduced in its own backward, as DDP does. Two exact schedules compete with
it on the same buckets: WFBP (DDP's schedule on the primary, with the least bookkeeping and one
link's threads) and DeAR, which also hides its all-gathers under the next forward, over the primary
alone or, where the secondary has a network of its own, over both (buckets balanced between them).
The strategy predicts each from the same measured stage times and runs the fastest, a more complex
schedule only when clearly faster; real steps then confirm it against the runner-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from commsched.deft.plan import FORWARD, LINK_NAMES, DeFTPlan, Item, Launch, Timings, no_delay_plan

DEAR_MARGIN = 0.02
"""DeAR must be predicted this much faster (a fraction of the plan's time) to be chosen: the model
leaves out what the two share (optimizer, data) and a close call is not worth a different schedule."""


@dataclass(frozen=True)
class Sent:
    """One launch of the replay, and when its all-reduce ran on its link."""

    launch: Launch
    start: float
    end: float


@dataclass(frozen=True)
class Replay:
    iteration_s: float
    """Mean iteration time over one period in steady state."""
    starts: list[float]
    """When each replayed iteration started (prefix, then two periods)."""
    steady: list[Sent]
    """The launches of the steady period (the second one)."""


def replay(
    plan: DeFTPlan, forward_s: float, backward_s: float, ready_at: Sequence[float], cost: Callable[[Launch], float]
) -> Replay:
    """The plan on a compute lane and one FIFO lane per link: forward-stage launches start with the
    forward, older generations' backward launches when backward starts, this iteration's when their
    bucket is ready (`ready_at[bucket]`, seconds into backward); an iteration ends when backward
    has and every generation it steps is reduced."""
    link_free: dict[int, float] = {}
    done: dict[int, float] = {}
    starts: list[float] = []
    steady: list[Sent] = []
    first_steady = len(plan.prefix) + plan.n
    clock = 0.0
    for t in range(len(plan.prefix) + 2 * plan.n):
        it = plan.at(t)
        starts.append(clock)
        backward_start = clock + forward_s
        for launch in it.launches:
            if launch.stage == FORWARD:
                earliest = clock
            elif launch.generation != it.joins:
                earliest = backward_start
            else:
                earliest = backward_start + ready_at[plan.items[launch.item].bucket]
            start = max(link_free.get(launch.link, 0.0), earliest)
            end = link_free[launch.link] = start + cost(launch)
            done[launch.generation] = max(done.get(launch.generation, 0.0), end)
            if t >= first_steady:
                steady.append(Sent(launch, start, end))
        clock = max([backward_start + backward_s] + [done[g] for g in it.steps])
    return Replay((clock - starts[first_steady]) / plan.n, starts, steady)


def plan_seconds(plan: DeFTPlan, timings: Timings, bucket_numels: Sequence[int]) -> float:
    """The plan's steady iteration from per-bucket timings (an item costs its share of its bucket)."""
    ready_at, clock = [], 0.0
    for seconds in timings.backward:
        clock += seconds
        ready_at.append(clock)

    def cost(launch: Launch) -> float:
        item = plan.items[launch.item]
        return timings.costs[launch.link][item.bucket] * item.numel / bucket_numels[item.bucket]

    return replay(plan, timings.forward, sum(timings.backward), ready_at, cost).iteration_s


def dear_seconds(
    forward_s: float,
    backward: Sequence[float],
    reduce_scatter: Sequence[Sequence[float]],
    all_gather: Sequence[Sequence[float]],
    link_of: Optional[Sequence[int]] = None,
) -> float:
    """DeAR's steady iteration ([DeAR] §III) on buckets in backward order, each bucket's halves on
    link `link_of[b]` (default: all on link 0; `reduce_scatter[link][bucket]`): all-gathers chained
    per link from the start of forward, last bucket first, each bucket's share of the forward (its
    share of the backward, the only per-bucket compute measured) waiting for its own; then
    reduce-scatters chained per link as buckets become ready in backward."""
    n = len(backward)
    link_of = list(link_of) if link_of is not None else [0] * n
    total = sum(backward)
    share = [b / total for b in backward] if total > 0 else [1.0 / n] * n
    free: dict[int, float] = {}
    clock = 0.0
    for b in reversed(range(n)):
        free[link_of[b]] = free.get(link_of[b], 0.0) + all_gather[link_of[b]][b]
        clock = max(clock, free[link_of[b]]) + forward_s * share[b]
    ready, free = clock, {}
    for b in range(n):
        ready += backward[b]
        free[link_of[b]] = max(free.get(link_of[b], clock), ready) + reduce_scatter[link_of[b]][b]
    return max([ready, *free.values()])


def balanced_links(reduce_scatter: Sequence[Sequence[float]], all_gather: Sequence[Sequence[float]]) -> list[int]:
    """Each bucket (backward order) on the link where its two halves would end first, given the
    halves already placed: the list-scheduling rule, which keeps both links equally busy."""
    load = [0.0] * len(reduce_scatter)
    link_of = []
    for b in range(len(reduce_scatter[0])):
        link = min(range(len(load)), key=lambda l: (load[l] + reduce_scatter[l][b] + all_gather[l][b], l))
        load[link] += reduce_scatter[link][b] + all_gather[link][b]
        link_of.append(link)
    return link_of


def dear_is_faster(plan_s: float, dear_s: float) -> bool:
    return dear_s < plan_s * (1.0 - DEAR_MARGIN)


SIMPLER = ("wfbp", "dear", "plan")
"""The order a candidate must beat those before it in by `DEAR_MARGIN`: WFBP (DDP's schedule on the
primary), then DeAR, then DeFT's own plan."""


def ranked(predicted_s: dict[str, float]) -> list[str]:
    """The candidates best first: at each place, a candidate passes the best simpler one left only
    when predicted `DEAR_MARGIN` faster (a close call keeps the simpler schedule)."""
    order: list[str] = []
    left = [runs for runs in SIMPLER if runs in predicted_s]
    while left:
        best = left[0]
        for runs in left[1:]:
            if dear_is_faster(predicted_s[best], predicted_s[runs]):
                best = runs
        order.append(best)
        left.remove(best)
    return order


@dataclass(frozen=True)
class ScheduleChoice:
    """Which schedule runs the iterations after solving, and why."""

    runs: str
    """"plan" (DeFT's own replay), "dear" or "wfbp" (exact schedules on the same buckets)."""
    dear_links: tuple[str, ...] = ()
    """Under DeAR, the link of each bucket's halves."""
    predicted: dict = field(default_factory=dict)
    """`<runs>_ms` for each candidate predicted (wfbp, dear, and plan where it is not WFBP's schedule):
    its steady iteration in milliseconds (empty when DeAR was not predicted)."""
    alternative: Optional[tuple[str, tuple[str, ...]]] = None
    """The runner-up of the prediction (`runs`, `dear_links`), timed against this choice on real steps
    (`commsched.deft.confirm`); None when nothing else was a candidate."""
    measured: dict = field(default_factory=dict)
    """Median milliseconds per real step of each candidate timed, by `runs` (empty until confirmed)."""

    def runner_up(self) -> "ScheduleChoice":
        assert self.alternative is not None
        runs, links = self.alternative
        return ScheduleChoice(runs, tuple(links))

    def to_json(self) -> dict:
        return {
            **vars(self),
            "dear_links": list(self.dear_links),
            "alternative": [self.alternative[0], list(self.alternative[1])] if self.alternative else None,
        }

    @classmethod
    def from_json(cls, saved: dict) -> "ScheduleChoice":
        alternative = saved.get("alternative")
        return cls(
            saved["runs"],
            tuple(saved.get("dear_links", ())),
            dict(saved.get("predicted", {})),
            (alternative[0], tuple(alternative[1])) if alternative else None,
            dict(saved.get("measured", {})),
        )


def choose_schedule(
    plan: DeFTPlan,
    timings: Timings,
    numels: Sequence[int],
    mode: str,
    halves: Optional[tuple[list[list[float]], list[list[float]]]],
) -> ScheduleChoice:
    """`mode` "when_faster": of WFBP (every bucket all-reduced in its own backward on the primary),
    DeAR (on the primary, or balanced over both links, whichever is predicted faster) and the plan
    (when it is not WFBP's schedule), the one predicted fastest (`ranked`), with the next as the
    runner-up that real steps time against it; "when_undelayed": DeAR whenever the plan delays
    nothing; "never": the plan. `halves` is None where nothing was measured to compare (one process,
    or a timings file without DeAR's halves: a forced plan runs as solved)."""
    if mode == "never":
        return ScheduleChoice("plan")
    own = "wfbp" if plan.is_ddp else "plan"
    if halves is None:
        return ScheduleChoice(own)
    seconds = {"wfbp": plan_seconds(no_delay_plan([Item(b, 0, n) for b, n in enumerate(numels)]), timings, numels)}
    if own == "plan":
        seconds["plan"] = plan_seconds(plan, timings, numels)
    reduce_scatter, all_gather = halves
    link_options = [[0] * len(numels)]
    if len(reduce_scatter) > 1:
        link_options.append(balanced_links(reduce_scatter, all_gather))
    seconds["dear"], link_of = min(
        (dear_seconds(timings.forward, timings.backward, reduce_scatter, all_gather, c), c) for c in link_options
    )
    links = {"dear": tuple(LINK_NAMES[l] for l in link_of)}
    predicted = {f"{runs}_ms": s * 1e3 for runs, s in seconds.items()}
    if mode == "when_undelayed":
        runs = own if plan.delayed else "dear"
        return ScheduleChoice(runs, links.get(runs, ()), predicted)
    order = ranked(seconds)
    alternative = (order[1], links.get(order[1], ())) if len(order) > 1 else None
    return ScheduleChoice(order[0], links.get(order[0], ()), predicted, alternative)
