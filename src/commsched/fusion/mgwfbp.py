"""MG-WFBP ([MG-WFBP] §3-4): which consecutive gradients to merge into one all-reduce.

Gradients arrive in backward order at known times; each message starts once its last gradient is
ready and the previous message is done, and costs `cost(bytes)`. `plan_exact` is the O(L^2)
dynamic programme over contiguous groups:

    F[j] = min_{i<j} max(F[i], e_j) + cost(bytes(i+1..j))

exact for any non-decreasing cost (the chain's end is monotone in every earlier end).
`plan_greedy` is the paper's rule, kept as the baseline: merge the next gradient into the current
message iff it is ready before the message could start plus one startup time `a` (cost(0)).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Groups = list[list[int]]


def plan_exact(
    ready: Sequence[float], nbytes: Sequence[float], cost: Callable[[float], float], start: float = -math.inf
) -> tuple[Groups, float]:
    """Groups (indices into the inputs, in order) minimising the time the last message ends, and that time.
    `start`: when the link becomes free."""
    _check(ready, nbytes)
    n = len(ready)
    prefix = [0.0]
    for size in nbytes:
        prefix.append(prefix[-1] + size)
    best = [start] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            end = max(best[i], ready[j - 1]) + cost(prefix[j] - prefix[i])
            if end < best[j]:
                best[j], cut[j] = end, i
    groups: Groups = []
    j = n
    while j > 0:
        groups.append(list(range(cut[j], j)))
        j = cut[j]
    return groups[::-1], best[n]


def plan_greedy(
    ready: Sequence[float], nbytes: Sequence[float], cost: Callable[[float], float], start: float = -math.inf
) -> Groups:
    _check(ready, nbytes)
    startup = cost(0.0)
    groups: Groups = []
    link_free = start
    message_start = math.inf
    for i in range(len(ready)):
        if groups and ready[i] < message_start + startup:
            groups[-1].append(i)
            message_start = max(ready[i], link_free)
            continue
        if groups:
            link_free = message_start + cost(sum(nbytes[j] for j in groups[-1]))
        groups.append([i])
        message_start = max(ready[i], link_free)
    return groups


def chain_end(
    groups: Groups,
    ready: Sequence[float],
    nbytes: Sequence[float],
    cost: Callable[[float], float],
    start: float = -math.inf,
) -> float:
    """When the last message of `groups` ends (the objective both planners minimise)."""
    link_free = start
    for group in groups:
        link_free = max(link_free, max(ready[i] for i in group)) + cost(sum(nbytes[i] for i in group))
    return link_free


def _check(ready: Sequence[float], nbytes: Sequence[float]) -> None:
    if len(ready) != len(nbytes):
        raise ValueError(f"ready has {len(ready)} entries but nbytes has {len(nbytes)}")
