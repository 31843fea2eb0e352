"""`simulate(name, ...)`: the one entry point the CLI, the benchmark and the tests use.

Besides the simulator's own variants (per-layer buckets, fused, planned, priority scheduling), any
schedule registered with `commsched.register_schedule` is simulated by its own `Schedule.simulate`
on fixed `bucket_bytes` buckets: the registry hands it over (`register`), so the simulator itself
never imports a schedule (nor torch)."""

from __future__ import annotations

from typing import Callable, Optional

from commsched.errors import bad_value
from commsched.sim import compressed, timelines
from commsched.sim.cost_models import AlphaBeta, CostModel
from commsched.sim.priority import bytescheduler
from commsched.sim.timelines import Result
from commsched.sim.workload import Workload

SIM_SCHEDULES = (
    "syncea",
    "wfbp",
    "mgwfbp_greedy",
    "mgwfbp",
    "dear",
    "dear_fused",
    "dear_model",
    "bytescheduler",
    "deft",
)
COMPRESSED = ("topk", "hitopk", "hier_dense")
"""Exchanges of `commsched.sim.compressed` (wfbp's overlap, fixed `bucket_bytes` buckets): not run by default."""
NVLINK = AlphaBeta.from_rate(100e9, 5e-6)
"""The node-local link of the two-level exchanges unless given: 100 Gbit/s, 5 us."""

Simulate = Callable[[Workload, CostModel, int, list[list[int]]], Result]
REGISTERED: dict[str, Simulate] = {}
"""`Schedule.simulate` of every registered schedule, by name (`commsched.register_schedule` fills it)."""


def register(name: str, simulate: Simulate) -> None:
    REGISTERED[name] = simulate


def simulated_schedule_names() -> tuple[str, ...]:
    """What `simulate` accepts: the simulator's own variants, then the registered schedules."""
    return (*SIM_SCHEDULES, *COMPRESSED, *(n for n in REGISTERED if n not in SIM_SCHEDULES))


def simulate(
    name: str,
    workload: Workload,
    network: CostModel,
    workers: int,
    bucket_bytes: float = 25 * 2**20,
    partition_bytes: float = 4 * 2**20,
    mu: float = 1.65,
    density: float = 0.01,
    per_node: int = 8,
    intra: Optional[CostModel] = None,
) -> Result:
    """`bucket_bytes` sizes dear_fused's, deft's and the compressed exchanges' buckets; `partition_bytes`
    ByteScheduler's partitions; `mu` is deft's secondary link's all-reduce time over the primary's;
    `density`, `per_node` and `intra` (default `NVLINK`) shape the compressed and two-level exchanges,
    whose inter-node link is `network`."""
    if workers < 1:
        raise bad_value("workers", workers, "an integer >= 1")
    if name in COMPRESSED:
        buckets = timelines.fixed_size(workload, bucket_bytes)
        if name == "topk":
            return compressed.topk(workload, network, workers, density, buckets)
        if name == "hitopk":
            return compressed.hitopk(workload, network, intra or NVLINK, workers, per_node, density, buckets)
        return compressed.hier_dense(workload, network, intra or NVLINK, workers, per_node, buckets)
    if name == "syncea":
        return timelines.sync_easgd(workload, network, workers)
    if name == "wfbp":
        return timelines.wfbp(workload, network, workers)
    if name == "mgwfbp":
        return timelines.mgwfbp(workload, network, workers)
    if name == "mgwfbp_greedy":
        return timelines.mgwfbp(workload, network, workers, exact=False)
    if name == "dear":
        return timelines.dear(workload, network, workers)
    if name == "dear_fused":
        result = timelines.dear(workload, network, workers, timelines.fixed_size(workload, bucket_bytes))
        result.schedule = name
        return result
    if name == "dear_model":
        result = timelines.dear(workload, network, workers, timelines.dear_model_buckets(workload, network, workers)[0])
        result.schedule = name
        return result
    if name == "deft":
        from commsched.sim.deft_timeline import deft

        return deft(workload, network, workers, bucket_bytes, mu)
    if name == "bytescheduler":
        return bytescheduler(workload, network, workers, partition_bytes)
    if name in REGISTERED:
        return REGISTERED[name](workload, network, workers, timelines.fixed_size(workload, bucket_bytes))
    raise bad_value("schedule", name, simulated_schedule_names())
