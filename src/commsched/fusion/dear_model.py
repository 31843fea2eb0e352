"""A DeAR-aware fusion plan from a model of the iteration ([DeAR] §III-IV).

Under DeAR one grouping decides two pipelines: reduce-scatters overlapping backward (a FIFO chain
in backward order, like WFBP's) and all-gathers overlapping the next forward (issued together,
first-needed first; each layer waits for its group's). With units (layers with gradients) in
forward order, groups g_1..g_n and prefix sums A_k of the all-gather costs:

    T_forward  = max(t_ff, max_k A_k + fsuf(first unit of g_k))
    T_backward = max(t_bp, end of the reduce-scatter chain in backward order)

Each part alone has an exact O(L^2) programme (`plan_exact` for backward; `min_forward` below), so
`T_forward_min + T_backward_min` is a lower bound on any plan. The planner starts from both
optimal plans, improves their sum by local search (merge, split, move a boundary) and reports the
remaining gap to that bound: the stated approximation bound, per instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from commsched.fusion.mgwfbp import Groups, chain_end, plan_exact

Cost = Callable[[float], float]


@dataclass(frozen=True)
class DearInstance:
    fsuf: Sequence[float]  # per unit: forward time from its start to the end of forward
    ready: Sequence[float]  # per unit: time its gradient is complete, from the start of backward
    nbytes: Sequence[float]
    reduce_scatter: Cost
    all_gather: Cost
    t_ff: float
    t_bp: float

    @property
    def units(self) -> int:
        return len(self.nbytes)

    def forward_time(self, groups: Groups) -> float:
        gathered, end = 0.0, self.t_ff
        for group in groups:
            gathered += self.all_gather(sum(self.nbytes[i] for i in group))
            end = max(end, gathered + self.fsuf[group[0]])
        return end

    def backward_time(self, groups: Groups) -> float:
        backward = [list(reversed(g)) for g in reversed(groups)]
        order = [i for g in backward for i in g]
        position = {unit: k for k, unit in enumerate(order)}
        chain = [[position[i] for i in g] for g in backward]
        return max(
            self.t_bp,
            chain_end(
                chain, [self.ready[i] for i in order], [self.nbytes[i] for i in order], self.reduce_scatter, start=0.0
            ),
        )

    def time(self, groups: Groups) -> float:
        return self.forward_time(groups) + self.backward_time(groups)


@dataclass(frozen=True)
class DearPlan:
    groups: Groups  # unit indices, groups in forward order
    predicted: float
    lower_bound: float

    @property
    def gap(self) -> float:
        """The plan is at most this fraction slower than the best possible plan (model time)."""
        return self.predicted / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0


def min_forward(instance: DearInstance) -> tuple[Groups, float]:
    """Exact minimum of T_forward: V(j) = min_{e>=j} ag(bytes j..e) + max(fsuf_j, V(e+1)), from the right."""
    n = instance.units
    prefix = [0.0]
    for size in instance.nbytes:
        prefix.append(prefix[-1] + size)
    value = [math.inf] * n + [-math.inf]
    cut = [n] * (n + 1)
    for j in range(n - 1, -1, -1):
        for e in range(j, n):
            v = instance.all_gather(prefix[e + 1] - prefix[j]) + max(instance.fsuf[j], value[e + 1])
            if v < value[j]:
                value[j], cut[j] = v, e + 1
    groups, j = [], 0
    while j < n:
        groups.append(list(range(j, cut[j])))
        j = cut[j]
    return groups, max(instance.t_ff, value[0])


def min_backward(instance: DearInstance) -> tuple[Groups, float]:
    n = instance.units
    order = list(range(n - 1, -1, -1))  # backward order
    chain, end = plan_exact(
        [instance.ready[i] for i in order], [instance.nbytes[i] for i in order], instance.reduce_scatter, start=0.0
    )
    groups = [sorted(order[k] for k in group) for group in chain]
    return sorted(groups), max(instance.t_bp, end)


def _by_bytes(nbytes: Sequence[float], cap: float) -> Groups:
    """Consecutive units in backward order, a group closing once it holds >= cap bytes (forward order out)."""
    groups: Groups = [[]]
    filled = 0.0
    for i in reversed(range(len(nbytes))):
        if filled >= cap:
            groups.append([])
            filled = 0.0
        groups[-1].insert(0, i)
        filled += nbytes[i]
    return groups[::-1]


def _neighbours(groups: Groups) -> list[Groups]:
    out = []
    for k in range(len(groups) - 1):
        out.append(groups[:k] + [groups[k] + groups[k + 1]] + groups[k + 2 :])
        if len(groups[k]) > 1:
            out.append(groups[:k] + [groups[k][:-1], [groups[k][-1]] + groups[k + 1]] + groups[k + 2 :])
        if len(groups[k + 1]) > 1:
            out.append(groups[:k] + [groups[k] + [groups[k + 1][0]], groups[k + 1][1:]] + groups[k + 2 :])
    for k, group in enumerate(groups):
        for split in range(1, len(group)):
            out.append(groups[:k] + [group[:split], group[split:]] + groups[k + 1 :])
    return out


def plan_dear_model(instance: DearInstance, max_rounds: int = 100) -> DearPlan:
    if instance.units == 0:
        return DearPlan([], instance.t_ff + instance.t_bp, instance.t_ff + instance.t_bp)
    forward_groups, forward_min = min_forward(instance)
    backward_groups, backward_min = min_backward(instance)
    # local search from several starts: both halves' optima, and fixed byte caps from 1/64 of the model up
    # to all of it (at thousands of workers latency dominates, and neither half's optimum is near the sum's)
    total = sum(instance.nbytes)
    starts = [forward_groups, backward_groups, [[i] for i in range(instance.units)]]
    starts += [_by_bytes(instance.nbytes, total / 2**k) for k in range(7)]
    best = min(starts, key=instance.time)
    best_time = instance.time(best)
    for _ in range(max_rounds):
        candidate = min(_neighbours(best), key=instance.time, default=best)
        candidate_time = instance.time(candidate)
        if candidate_time >= best_time - 1e-12:
            break
        best, best_time = candidate, candidate_time
    return DearPlan(best, best_time, forward_min + backward_min)
