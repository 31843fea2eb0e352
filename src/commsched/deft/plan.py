"""DeFT's periodic plan: the queue machine of [DeFT] §III-B simulated until its state repeats.

Items are pieces of buckets (`Item`), in the order backward makes them ready. A *generation* is the
gradients of one iteration or the sum of several. The machine keeps a current queue (the unsent
items of the generation being synchronised) and a future queue (at most one whole unsent
generation, k_f iterations summed) and, per iteration:

- forward stage: (1) current queue not empty -> send a knapsack of it (capacity T_F per link);
- backward stage (capacity T_B per link):
  (2) the current queue does not fit -> send a knapsack of it; this iteration joins the future queue;
  (3) it fits -> send it all, step with it at the end of backward; this iteration joins the future
      generation, whose items fill what is left of T_B (RecursiveKnapsack); its unsent rest becomes
      current (if nothing is left it is complete and steps too);
  (4) the current queue is empty -> the future queue plus this iteration form the generation; send
      a RecursiveKnapsack of it; step if nothing is left, else the rest becomes current.

The state at an iteration's start (unsent items, k of the current and of the future generation)
determines everything after it, so the first repeated state closes the period. Every rank replays
the plan (rank 0 computes it, the others receive it and check its hash).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from commsched.deft.solvers import NONE, Assignment, multi_knapsack, partition_sizes, recursive_knapsack

FORWARD, BACKWARD = "forward", "backward"
LINK_NAMES = ("primary", "secondary")


@dataclass(frozen=True)
class Item:
    """A piece of a bucket's flat buffer: elements `start .. start+numel` of bucket `bucket`."""

    bucket: int
    start: int
    numel: int


@dataclass(frozen=True)
class Timings:
    """What the plan is solved from, in seconds: the stages' compute and each item's all-reduce per link."""

    forward: float
    """T_F: one forward pass."""
    backward: list[float]
    """Per item, the backward time until it is ready after the previous item (sum: T_B)."""
    costs: list[list[float]]
    """costs[link][item]: the item's all-reduce on that link (0 primary, 1 secondary)."""

    @property
    def mu(self) -> float:
        """The links' speed ratio, c^S / c^P over all items (inf without a secondary)."""
        if len(self.costs) < 2:
            return math.inf
        return sum(self.costs[1]) / max(sum(self.costs[0]), 1e-12)


@dataclass(frozen=True)
class Launch:
    """One all-reduce the plan issues: item `item` of generation `generation` on link `link` (0
    primary, 1 secondary), in the `stage` (forward or backward) of the iteration that holds it."""

    generation: int
    item: int
    link: int
    stage: str


@dataclass(frozen=True)
class Iteration:
    """What one iteration does: which generation its gradients join, what it sends, which generations it steps."""

    joins: int
    launches: tuple[Launch, ...]
    steps: tuple[int, ...]


@dataclass(frozen=True)
class DeFTPlan:
    items: list[Item]
    prefix: tuple[Iteration, ...]
    period: tuple[Iteration, ...]
    generations_per_period: int
    capacity: float
    """The knapsacks' capacity as a multiple of the stage times (inf: everything fits, no delay)."""
    k: tuple[int, ...] = field(default=())
    """The batch-size sequence K of one period: iterations summed in each generation stepped in it."""

    @property
    def n(self) -> int:
        return len(self.period)

    def at(self, iteration: int) -> Iteration:
        """Iteration `iteration` of the replay, generation numbers made absolute."""
        if iteration < len(self.prefix):
            return self.prefix[iteration]
        repeat, position = divmod(iteration - len(self.prefix), self.n)
        shift = repeat * self.generations_per_period
        it = self.period[position]
        return Iteration(
            it.joins + shift,
            tuple(Launch(l.generation + shift, l.item, l.link, l.stage) for l in it.launches),
            tuple(g + shift for g in it.steps),
        )

    def steps_until_applied(self, iteration: int) -> int:
        """Optimizer steps taken after iteration `iteration`'s forward and before the generation it joins
        steps: how late that iteration's gradient is applied."""
        joins = self.at(iteration).joins
        taken = 0
        for t in range(iteration, iteration + len(self.prefix) + 2 * self.n + 1):
            for number in self.at(t).steps:
                if number == joins:
                    return taken
                taken += 1
        raise ValueError(f"generation {joins} of iteration {iteration} never steps: {self.describe()}")

    @property
    def staleness(self) -> int:
        """The most iterations any generation waits after its last gradient before it steps (0: each
        generation steps in the backward of its last iteration, as a synchronous step of batch kB)."""
        last_join: dict[int, int] = {}
        worst = 0
        for t in range(len(self.prefix) + 2 * self.n):
            it = self.at(t)
            last_join[it.joins] = t
            worst = max([worst, *(t - last_join.get(g, t) for g in it.steps)])
        return worst

    @property
    def delayed(self) -> bool:
        return any(k != 1 for k in self.k) or any(
            l.stage == FORWARD or l.generation != it.joins for it in self.period for l in it.launches
        )

    @property
    def is_ddp(self) -> bool:
        """Every iteration's gradients all-reduced in its own backward on the primary and stepped at its
        end: DDP's schedule (WFBP runs it with less bookkeeping)."""
        return not self.delayed and all(l.link == 0 for it in (*self.prefix, *self.period) for l in it.launches)

    def to_json(self) -> dict:
        return {
            "items": [asdict(i) for i in self.items],
            "prefix": [_iteration_json(i) for i in self.prefix],
            "period": [_iteration_json(i) for i in self.period],
            "generations_per_period": self.generations_per_period,
            "capacity": None if math.isinf(self.capacity) else self.capacity,
            "k": list(self.k),
        }

    @classmethod
    def from_json(cls, data: dict) -> "DeFTPlan":
        return cls(
            [Item(**i) for i in data["items"]],
            tuple(_iteration_from(i) for i in data["prefix"]),
            tuple(_iteration_from(i) for i in data["period"]),
            data["generations_per_period"],
            math.inf if data["capacity"] is None else data["capacity"],
            tuple(data["k"]),
        )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        links = sorted({LINK_NAMES[l.link] for it in self.period for l in it.launches})
        return (
            f"period N={self.n}, K={list(self.k)}, staleness {self.staleness}, {len(self.items)} item(s), capacity "
            f"{'unlimited' if math.isinf(self.capacity) else f'{self.capacity:.3g}x'}, links {'+'.join(links)}"
        )


def _iteration_json(it: Iteration) -> dict:
    return {"joins": it.joins, "steps": list(it.steps), "launches": [asdict(l) for l in it.launches]}


def _iteration_from(data: dict) -> Iteration:
    return Iteration(data["joins"], tuple(Launch(**l) for l in data["launches"]), tuple(data["steps"]))


@dataclass
class _Generation:
    number: int
    k: int
    unsent: list[int]  # item indices, ready order


def no_delay_plan(items: list[Item]) -> DeFTPlan:
    """Every item of every iteration sent in its own backward on the primary link: DDP's schedule."""
    it = Iteration(0, tuple(Launch(0, i, 0, BACKWARD) for i in range(len(items))), (0,))
    return DeFTPlan(items, (), (it,), 1, math.inf, (1,))


def solve_plan(items: list[Item], timings: Timings, capacity: float = 1.0, max_iterations: int = 10_000) -> DeFTPlan:
    """Simulate the queue machine with knapsacks of `capacity` x the stage times until its state repeats."""
    if math.isinf(capacity):
        return no_delay_plan(items)
    links = len(timings.costs)
    smallest = capacity * min(timings.forward, sum(timings.backward))
    too_big = [i for i, c in enumerate(timings.costs[0]) if c > smallest + 1e-12]
    if too_big:
        raise ValueError(
            f"items {too_big} cost more than the smallest knapsack ({smallest:.4g} s): cut them first (plan_for)"
        )
    t_forward = [timings.forward * capacity] * links
    t_backward = [sum(timings.backward) * capacity] * links
    values = [c + 1e-9 for c in timings.costs[0]]  # a free item is still worth sending
    current: Optional[_Generation] = None
    future: Optional[_Generation] = None
    next_number = 0
    seen: dict[tuple, int] = {}
    history: list[Iteration] = []
    started: list[int] = []  # generations started before each iteration
    stepped_k: list[list[int]] = []

    def sub(indices: list[int]) -> tuple[list[list[float]], list[float], list[float]]:
        return (
            [[timings.costs[l][i] for i in indices] for l in range(links)],
            [values[i] for i in indices],
            [timings.backward[i] for i in indices],
        )

    def take(generation: _Generation, assignment: Assignment, indices: list[int], stage: str) -> list[Launch]:
        sent = [
            Launch(generation.number, indices[j], link, stage)
            for j, link in enumerate(assignment.links)
            if link != NONE
        ]
        chosen = {launch.item for launch in sent}
        generation.unsent = [i for i in generation.unsent if i not in chosen]
        return sent

    def load(sent: list[Launch]) -> list[float]:
        return [sum(timings.costs[l][s.item] for s in sent if s.link == l) for l in range(links)]

    for t in range(max_iterations):
        key = (tuple(current.unsent) if current else None, current.k if current else 0, future.k if future else 0)
        if key in seen:
            start = seen[key]
            period = tuple(history[start:])
            ks = tuple(k for ks_t in stepped_k[start:] for k in ks_t)
            return DeFTPlan(items, tuple(history[:start]), period, next_number - started[start], capacity, ks)
        seen[key] = t
        started.append(next_number)
        launches: list[Launch] = []
        steps: list[int] = []
        ks: list[int] = []
        if current is not None:  # case (1)
            weights, vals, _ = sub(current.unsent)
            launches += take(current, multi_knapsack(weights, t_forward, vals), list(current.unsent), FORWARD)
            if not current.unsent:  # all of it went in the forward stage: it steps at the end of backward
                steps.append(current.number)
                ks.append(current.k)
                current = None
        if current is not None:
            weights, vals, _ = sub(current.unsent)
            fit = multi_knapsack(weights, t_backward, vals)
            sent = take(current, fit, list(current.unsent), BACKWARD)
            launches += sent
            if future is None:
                future, next_number = _Generation(next_number, 0, list(range(len(items)))), next_number + 1
            future.k += 1
            joins = future.number
            if not current.unsent:  # case (3)
                steps.append(current.number)
                ks.append(current.k)
                room = [c - used for c, used in zip(t_backward, load(sent))]
                current, future = future, None
                launches += _fill(current, room, sub, take)
        else:  # case (4)
            if future is None:
                future, next_number = _Generation(next_number, 0, list(range(len(items)))), next_number + 1
            future.k += 1
            joins = future.number
            current, future = future, None
            launches += _fill(current, t_backward, sub, take)
        if current is not None and not current.unsent and current.number not in steps:
            steps.append(current.number)
            ks.append(current.k)
            current = None
        history.append(Iteration(joins, tuple(launches), tuple(steps)))
        stepped_k.append(ks)
    raise RuntimeError(f"DeFT's queue machine did not repeat within {max_iterations} iterations")


def _fill(generation: _Generation, room: Sequence[float], sub, take) -> list[Launch]:
    """RecursiveKnapsack over a generation whose newest gradients become ready during this backward."""
    if max(room) <= 0:
        return []
    indices = list(generation.unsent)
    weights, vals, backward = sub(indices)
    return take(generation, recursive_knapsack(weights, list(room), vals, backward), indices, BACKWARD)


def plan_for(bucket_numels: Sequence[int], bucket_timings: Timings, capacity: float = 1.0) -> DeFTPlan:
    """Cut buckets into items that fit the smallest knapsack ([DeFT] §III-D), then solve the plan.

    `bucket_timings` holds per-bucket times; an item's cost is its share of its bucket's (by elements)."""
    if math.isinf(capacity):
        return no_delay_plan([Item(b, 0, n) for b, n in enumerate(bucket_numels)])
    smallest = capacity * min(bucket_timings.forward, sum(bucket_timings.backward))
    items = []
    for b, parts in enumerate(partition_sizes(list(bucket_numels), list(bucket_timings.costs[0]), smallest)):
        start = 0
        for numel in parts:
            items.append(Item(b, start, numel))
            start += numel
    share = [item.numel / bucket_numels[item.bucket] for item in items]
    backward = [bucket_timings.backward[item.bucket] if item.start == 0 else 0.0 for item in items]
    costs = [[per_bucket[item.bucket] * f for item, f in zip(items, share)] for per_bucket in bucket_timings.costs]
    return solve_plan(items, Timings(bucket_timings.forward, backward, costs), capacity)
