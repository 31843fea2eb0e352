"""DeFT in the simulator: the plan solved from the workload's times, replayed on a compute lane and
one lane per link until it repeats; the iteration time is the mean over one period in steady state.

Buckets are fixed-size (backward order); the primary link's costs come from the network model and
the secondary's are `mu` times them (in a run, mu is measured).
"""

from __future__ import annotations

from typing import Optional, Sequence

from commsched.deft.iteration_model import replay
from commsched.deft.plan import LINK_NAMES, DeFTPlan, Launch, Timings, plan_for
from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Result, bytes_of_bucket, compute_spans, fixed_size, grad_ready
from commsched.sim.workload import Workload
from commsched.trace import Span


def deft_plan(
    workload: Workload, network: CostModel, workers: int, buckets: list[list[int]], mu: float, capacity: float = 1.0
) -> DeFTPlan:
    ready = grad_ready(workload)
    ready_at = [max(ready[i] for i in bucket) for bucket in buckets]
    backward = [ready_at[0]] + [max(0.0, b - a) for a, b in zip(ready_at, ready_at[1:])]
    primary = [network.time("all_reduce", bytes_of_bucket(workload, bucket), workers) for bucket in buckets]
    timings = Timings(workload.forward_s, backward, [primary, [c * mu for c in primary]])
    return plan_for([max(1, bytes_of_bucket(workload, bucket) // 4) for bucket in buckets], timings, capacity)


def deft(
    workload: Workload,
    network: CostModel,
    workers: int,
    bucket_bytes: float = 25 * 2**20,
    mu: float = 1.65,
    capacity: float = 1.0,
    buckets: Optional[Sequence[Sequence[int]]] = None,
) -> Result:
    """`buckets` (layer indices, backward order): default fixed `bucket_bytes` buckets."""
    buckets = fixed_size(workload, bucket_bytes) if buckets is None else [list(b) for b in buckets]
    plan = deft_plan(workload, network, workers, buckets, mu, capacity)
    ready = grad_ready(workload)
    bucket_ready = [max(ready[i] for i in bucket) for bucket in buckets]
    item_bytes = [
        bytes_of_bucket(workload, buckets[item.bucket])
        * item.numel
        / sum(i.numel for i in plan.items if i.bucket == item.bucket)
        for item in plan.items
    ]

    def cost(launch: Launch) -> float:
        return network.time("all_reduce", item_bytes[launch.item], workers) * (mu if launch.link else 1.0)

    replayed = replay(plan, workload.forward_s, workload.backward_s, bucket_ready, cost)
    spans: list[Span] = []
    for start in replayed.starts[len(plan.prefix) + plan.n :]:  # the trace shows one period in steady state
        forward, t_ff = compute_spans(workload, start, "forward")
        spans += forward + compute_spans(workload, t_ff, "backward")[0]
    spans += [
        Span(
            f"link: {LINK_NAMES[s.launch.link]}", f"all_reduce g{s.launch.generation} i{s.launch.item}", s.start, s.end
        )
        for s in replayed.steady
    ]
    result = Result("deft", replayed.iteration_s, spans, len(plan.items))
    result.plan = plan  # type: ignore[attr-defined]
    return result
