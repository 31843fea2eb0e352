"""MG-WFBP's merge rule (mg-wfbp.txt §4, Lemma 1 / Algorithm 1) on layer-wise timings.

Walking the backward order from the first gradient produced, layer l's gradient is merged into the
next one's message exactly when doing so ends that next message's communication earlier than
sending the two separately. This is the paper's greedy plan; the exact contiguous-group optimum is
issue 5's dynamic programme.
"""

from __future__ import annotations

from typing import Callable, Sequence


def plan_mgwfbp(ready: Sequence[float], nbytes: Sequence[float], cost: Callable[[float], float]) -> list[list[int]]:
    """`ready[i]`: time the i-th gradient (in backward order) is complete; `cost(bytes)`: all-reduce
    seconds. Returns groups of indices into the inputs, in communication order."""
    if len(ready) != len(nbytes):
        raise ValueError(f"ready has {len(ready)} entries but nbytes has {len(nbytes)}")
    groups: list[list[int]] = []
    link_free = float("-inf")
    pending: list[int] = []  # the current message, not yet sent
    pending_bytes = 0.0
    for i in range(len(ready)):
        if not pending:
            pending, pending_bytes = [i], nbytes[i]
            continue
        send_now_end = max(max(ready[j] for j in pending), link_free) + cost(pending_bytes)
        separate_end = max(ready[i], send_now_end) + cost(nbytes[i])
        merged_end = max(ready[i], link_free) + cost(pending_bytes + nbytes[i])
        if merged_end < separate_end:
            pending.append(i)
            pending_bytes += nbytes[i]
        else:
            groups.append(pending)
            link_free = send_now_end
            pending, pending_bytes = [i], nbytes[i]
    if pending:
        groups.append(pending)
    return groups
