"""ByteScheduler-like priority scheduling with tensor partitioning ([DeAR] §II-C, [Peng et al. 2019]).

Gradients are cut into partitions of at most `partition_bytes`; whenever the link is free it sends
the ready partition of the layer nearest the input (forward needs it first), so the next forward
can start before the whole all-reduce is done. Each layer's forward waits for all of its
partitions. Iterations overlap, so the steady state is measured over several simulated iterations.
"""

from __future__ import annotations

import math

from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Result
from commsched.sim.workload import Workload
from commsched.trace import Span


def bytescheduler(
    workload: Workload, network: CostModel, workers: int, partition_bytes: float = 4 * 2**20, iterations: int = 6
) -> Result:
    if partition_bytes <= 0:
        raise ValueError(f"partition_bytes must be positive, got {partition_bytes}")
    layers = workload.layers
    pieces = [math.ceil(l.nbytes / partition_bytes) for l in layers]
    pending: list[tuple[float, int, int, float]] = []  # (ready time, iteration, layer, bytes)
    left: dict[tuple[int, int], int] = {}
    done_at: dict[tuple[int, int], float] = {}  # (iteration, layer) -> its last partition arrived
    spans: list[Span] = []
    link_free = 0.0

    def run_link(until: float) -> None:
        """Start every transfer that starts before `until`: at each start, the older iteration's
        layer nearest the input among the partitions ready by then."""
        nonlocal link_free
        while pending:
            start = max(link_free, min(p[0] for p in pending))
            if start >= until:
                return
            choice = min((p for p in pending if p[0] <= start), key=lambda p: (p[1], p[2]))
            pending.remove(choice)
            _, it, layer, size = choice
            link_free = start + network.time("all_reduce", size, workers)
            spans.append(Span("link", f"all_reduce {layers[layer].name}", start, link_free))
            left[(it, layer)] -= 1
            if left[(it, layer)] == 0:
                done_at[(it, layer)] = link_free

    clock = 0.0
    forward_starts: list[float] = []
    for it in range(iterations):
        for i, layer in enumerate(layers):
            if it > 0 and pieces[i]:
                if (it - 1, i) not in done_at:
                    run_link(float("inf"))  # compute is blocked: nothing new can become ready
                clock = max(clock, done_at[(it - 1, i)])
            if i == 0:
                forward_starts.append(clock)
            spans.append(Span("compute", f"F {layer.name}", clock, clock + layer.forward_s))
            clock += layer.forward_s
        for i in reversed(range(len(layers))):
            layer = layers[i]
            spans.append(Span("compute", f"B {layer.name}", clock, clock + layer.backward_s))
            clock += layer.backward_s
            run_link(clock)
            left[(it, i)] = pieces[i]
            for p in range(pieces[i]):
                pending.append((clock, it, i, min(partition_bytes, layer.nbytes - p * partition_bytes)))
    first = len(forward_starts) // 2
    iteration_s = (forward_starts[-1] - forward_starts[first]) / (len(forward_starts) - 1 - first)
    return Result("bytescheduler", iteration_s, spans, sum(pieces))
