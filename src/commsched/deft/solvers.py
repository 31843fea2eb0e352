"""DeFT's knapsack solvers ([DeFT] §III-B to III-D), as pure functions.

An item is a bucket; its weight on a link is the time its all-reduce takes on that link, its value
the time it takes on the primary link (so a bucket moved is worth the same whichever link moves
it); a knapsack is one link during one stage, its capacity the stage's compute time. The paper's
printed capacity formula and its prose disagree on which link gets mu times the other: giving each
link the stage's time and weighing each bucket by that link's own measured time is equivalent and
needs no mu (mu = c_secondary / c_primary is still measured and reported).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

NONE = -1  # an item left out


@dataclass(frozen=True)
class Assignment:
    """`links[i]` is the link (0 primary, 1 secondary) item i goes on, or NONE."""

    links: tuple[int, ...]
    value: float

    def chosen(self, link: Optional[int] = None) -> list[int]:
        return [i for i, l in enumerate(self.links) if l != NONE and (link is None or l == link)]


def knapsack_exact(weights: Sequence[float], capacity: float, values: Optional[Sequence[float]] = None) -> list[int]:
    """0/1 knapsack, exact (branch and bound over items by value density): the indices chosen."""
    values = list(weights if values is None else values)
    order = sorted(range(len(weights)), key=lambda i: -values[i] / max(weights[i], 1e-12))
    best: list[list[int]] = [[]]
    best_value = [0.0]

    def search(k: int, room: float, value: float, taken: list[int]) -> None:
        if value > best_value[0] + 1e-12:
            best_value[0], best[0] = value, list(taken)
        if k == len(order):
            return
        bound, free = value, room  # the fractional relaxation bounds what the rest can add
        for i in order[k:]:
            if weights[i] <= free:
                bound, free = bound + values[i], free - weights[i]
            else:
                bound += values[i] * free / max(weights[i], 1e-12)
                break
        if bound <= best_value[0] + 1e-12:
            return
        i = order[k]
        if weights[i] <= room:
            taken.append(i)
            search(k + 1, room - weights[i], value + values[i], taken)
            taken.pop()
        search(k + 1, room, value, taken)

    search(0, capacity, 0.0, [])
    return sorted(best[0])


def makespan(links: Sequence[int], weights: Sequence[Sequence[float]], capacities: Sequence[float]) -> float:
    """The fullest knapsack's load as a fraction of its capacity: when the chosen links finish."""
    loads = [0.0] * len(capacities)
    for i, l in enumerate(links):
        if l != NONE:
            loads[l] += weights[l][i]
    return max(load / c if c > 0 else (math.inf if load else 0.0) for load, c in zip(loads, capacities))


def multi_knapsack_greedy(
    weights: Sequence[Sequence[float]], capacities: Sequence[float], values: Sequence[float]
) -> Assignment:
    """[DeFT] §III-C: the knapsack with the smallest capacity (in value units) first, the longest
    (most valuable) item first; `weights[link][i]` is item i's time on that link.

    When every item fits, that rule can put all of them on the slower link while the faster one
    idles; a balanced assignment (longest item first, to the link where it would finish first) is
    taken instead whenever it carries at least as much value, so the paper's bound still holds."""
    paper = _smallest_knapsack_first(weights, capacities, values)
    balanced = _earliest_finish(weights, capacities, values)
    if balanced.value >= paper.value - 1e-12 and makespan(balanced.links, weights, capacities) <= makespan(
        paper.links, weights, capacities
    ):
        return balanced
    return paper


def _earliest_finish(
    weights: Sequence[Sequence[float]], capacities: Sequence[float], values: Sequence[float]
) -> Assignment:
    links = [NONE] * len(values)
    loads = [0.0] * len(capacities)
    for i in sorted(range(len(values)), key=lambda i: -values[i]):
        fits = [l for l in range(len(capacities)) if loads[l] + weights[l][i] <= capacities[l] + 1e-12]
        if fits:
            link = min(fits, key=lambda l: ((loads[l] + weights[l][i]) / max(capacities[l], 1e-12), l))
            links[i], loads[link] = link, loads[link] + weights[link][i]
    return Assignment(tuple(links), sum(values[i] for i, l in enumerate(links) if l != NONE))


def _smallest_knapsack_first(
    weights: Sequence[Sequence[float]], capacities: Sequence[float], values: Sequence[float]
) -> Assignment:
    links = [NONE] * len(values)
    # a link's capacity in primary time: how much value it can carry at this stage
    reach = [capacities[l] * (sum(values) / max(sum(weights[l]), 1e-12)) for l in range(len(capacities))]
    for link in sorted(range(len(capacities)), key=lambda l: reach[l]):
        room = capacities[link]
        for i in sorted(range(len(values)), key=lambda i: -values[i]):
            if links[i] == NONE and weights[link][i] <= room:
                links[i], room = link, room - weights[link][i]
    return Assignment(tuple(links), sum(values[i] for i, l in enumerate(links) if l != NONE))


def multi_knapsack_exact(
    weights: Sequence[Sequence[float]], capacities: Sequence[float], values: Sequence[float]
) -> Assignment:
    """Every assignment of every item to a link or to none: for small instances (tests, and the
    strategy when there are at most `EXACT_ITEMS` buckets). Among the best, the one whose links finish first."""
    best = Assignment(tuple([NONE] * len(values)), 0.0)
    best_makespan = 0.0
    for links in itertools.product([NONE, *range(len(capacities))], repeat=len(values)):
        load = [0.0] * len(capacities)
        for i, l in enumerate(links):
            if l != NONE:
                load[l] += weights[l][i]
        if all(load[l] <= capacities[l] + 1e-12 for l in range(len(capacities))):
            value = sum(values[i] for i, l in enumerate(links) if l != NONE)
            if value > best.value + 1e-12 or (
                value > best.value - 1e-12 and makespan(links, weights, capacities) < best_makespan - 1e-12
            ):
                best, best_makespan = Assignment(tuple(links), value), makespan(links, weights, capacities)
    return best


EXACT_ITEMS = 8  # 3**8 = 6561 assignments: the exact solver is used up to here


def multi_knapsack(
    weights: Sequence[Sequence[float]], capacities: Sequence[float], values: Sequence[float]
) -> Assignment:
    if len(values) <= EXACT_ITEMS:
        return multi_knapsack_exact(weights, capacities, values)
    return multi_knapsack_greedy(weights, capacities, values)


Solver = Callable[[Sequence[Sequence[float]], Sequence[float], Sequence[float]], Assignment]


def recursive_knapsack(
    weights: Sequence[Sequence[float]],
    capacities: Sequence[float],
    values: Sequence[float],
    backward: Sequence[float],
    solve: Solver = multi_knapsack,
) -> Assignment:
    """Algorithm 1 (RecursiveKnapsack) over items in the order backward makes them ready: the best of
    solving for every suffix, where dropping the earliest-ready item costs the next item's backward
    time (what the stage can no longer use for communication if it waits for that item)."""
    n = len(values)
    best = Assignment(tuple([NONE] * n), 0.0)
    lost = 0.0
    for start in range(n):
        if start > 0:
            lost += backward[start]
        room = [c - lost for c in capacities]
        if max(room) <= 0:
            break
        part = solve([w[start:] for w in weights], room, values[start:])
        if part.value > best.value + 1e-12:
            best = Assignment(tuple([NONE] * start) + part.links, part.value)
    return best


def partition_sizes(sizes: Sequence[int], costs: Sequence[float], smallest_capacity: float) -> list[list[int]]:
    """Split each bucket (`sizes[j]` elements, costing `costs[j]`, cost taken as proportional to
    elements) into as few near-equal parts as keep every part within the smallest knapsack
    ([DeFT] §III-D): the part sizes of each bucket."""
    if smallest_capacity <= 0:
        raise ValueError("the smallest knapsack has no capacity")
    parts = []
    for size, cost in zip(sizes, costs):
        if cost <= smallest_capacity or size <= 1:
            parts.append([size])
            continue
        per_part = int(smallest_capacity * size / cost)  # most elements a part may hold
        if per_part < 1:
            raise ValueError(
                f"one element of a bucket costs {cost / size:.3g} s, more than the smallest knapsack "
                f"({smallest_capacity:.3g} s)"
            )
        count = -(-size // per_part)
        base, extra = divmod(size, count)
        parts.append([base + 1] * extra + [base] * (count - extra))
    return parts
