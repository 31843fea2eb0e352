"""One training iteration of each schedule as an event timeline: a compute lane that runs the
layers' forward then backward, and one link that runs collectives one at a time.

Buckets are lists of layer indices (forward order numbering) in the order their communication is
issued, i.e. backward order, as `commsched.comm.buckets.BucketPlan` lays them out. Layers without
gradient bytes never communicate. Optimizer time is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from commsched.fusion.dear_model import DearInstance, DearPlan, plan_dear_model
from commsched.fusion.mgwfbp import plan_exact, plan_greedy
from commsched.sim.cost_models import CostModel
from commsched.sim.workload import Workload
from commsched.trace import Span

Buckets = Sequence[Sequence[int]]


@dataclass
class Result:
    schedule: str
    iteration_s: float
    spans: list[Span] = field(default_factory=list)
    buckets: int = 0

    def speedup(self, workload: Workload, workers: int) -> float:
        """Throughput of `workers` workers over one worker that never communicates."""
        return workers * (workload.forward_s + workload.backward_s) / self.iteration_s


def per_layer(workload: Workload) -> list[list[int]]:
    return [[i] for i in reversed(range(len(workload.layers))) if workload.layers[i].nbytes > 0]


def fixed_size(workload: Workload, cap_bytes: float) -> list[list[int]]:
    """Consecutive layers in backward order, a bucket closing once it holds >= cap_bytes."""
    buckets: list[list[int]] = [[]]
    filled = 0
    for i in per_layer(workload):
        if filled >= cap_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].extend(i)
        filled += workload.layers[i[0]].nbytes
    return [b for b in buckets if b]


def grad_ready(workload: Workload, backward_start: float = 0.0) -> list[float]:
    """Time each layer's gradient is complete, by layer index."""
    ready = [0.0] * len(workload.layers)
    clock = backward_start
    for i in reversed(range(len(workload.layers))):
        clock += workload.layers[i].backward_s
        ready[i] = clock
    return ready


def mgwfbp_buckets(workload: Workload, network: CostModel, workers: int, exact: bool = True) -> list[list[int]]:
    """MG-WFBP's plan on the layers with gradients: the exact programme, or the paper's greedy rule."""
    order = [b[0] for b in per_layer(workload)]
    ready = grad_ready(workload)
    args = (
        [ready[i] for i in order],
        [workload.layers[i].nbytes for i in order],
        lambda m: network.time("all_reduce", m, workers),
    )
    groups = plan_exact(*args)[0] if exact else plan_greedy(*args)
    return [[order[j] for j in group] for group in groups]


def compute_spans(workload: Workload, start: float, phase: str) -> tuple[list[Span], float]:
    spans, clock = [], start
    indices = range(len(workload.layers)) if phase == "forward" else reversed(range(len(workload.layers)))
    for i in indices:
        layer = workload.layers[i]
        seconds = layer.forward_s if phase == "forward" else layer.backward_s
        spans.append(Span("compute", f"{phase[0].upper()} {layer.name}", clock, clock + seconds))
        clock += seconds
    return spans, clock


def bytes_of_bucket(workload: Workload, bucket: Sequence[int]) -> int:
    return sum(workload.layers[i].nbytes for i in bucket)


def _chain(
    workload: Workload, network: CostModel, workers: int, buckets: Buckets, collective: str, backward_start: float
) -> tuple[list[Span], float]:
    """Collectives issued as each bucket's last gradient is ready, FIFO on the link."""
    ready = grad_ready(workload, backward_start)
    spans, link_free = [], backward_start
    for index, bucket in enumerate(buckets):
        start = max(link_free, max(ready[i] for i in bucket))
        link_free = start + network.time(collective, bytes_of_bucket(workload, bucket), workers)
        spans.append(Span("link", f"{collective} b{index}", start, link_free))
    return spans, link_free


def wfbp(workload: Workload, network: CostModel, workers: int, buckets: Buckets | None = None) -> Result:
    """[MG-WFBP] Eq. 6-8: all-reduce each bucket when ready; the step waits for the last one."""
    buckets = per_layer(workload) if buckets is None else buckets
    forward, t_ff = compute_spans(workload, 0.0, "forward")
    backward, t_end = compute_spans(workload, t_ff, "backward")
    comm, link_free = _chain(workload, network, workers, buckets, "all_reduce", t_ff)
    return Result("wfbp", max(t_end, link_free), forward + backward + comm, len(buckets))


def after_backward(
    name: str, workload: Workload, network: CostModel, workers: int, buckets: Buckets, collectives: Sequence[str]
) -> Result:
    """A schedule that overlaps nothing: forward, backward, then each bucket's `collectives` in turn
    (`commsched.Schedule.simulate`'s default for a schedule that describes no timeline of its own)."""
    forward, t_ff = compute_spans(workload, 0.0, "forward")
    backward, clock = compute_spans(workload, t_ff, "backward")
    comm = []
    for index, bucket in enumerate(buckets):
        for collective in collectives:
            seconds = network.time(collective, bytes_of_bucket(workload, bucket), workers)
            comm.append(Span("link", f"{collective} b{index}", clock, clock + seconds))
            clock += seconds
    return Result(name, clock, forward + backward + comm, len(buckets))


def sync_easgd(workload: Workload, network: CostModel, workers: int) -> Result:
    """[MG-WFBP] Eq. 9: one all-reduce of everything after backward."""
    forward, t_ff = compute_spans(workload, 0.0, "forward")
    backward, t_end = compute_spans(workload, t_ff, "backward")
    t_ar = network.time("all_reduce", workload.nbytes, workers)
    return Result("syncea", t_end + t_ar, forward + backward + [Span("link", "all_reduce", t_end, t_end + t_ar)], 1)


def mgwfbp(workload: Workload, network: CostModel, workers: int, exact: bool = True) -> Result:
    result = wfbp(workload, network, workers, mgwfbp_buckets(workload, network, workers, exact))
    result.schedule = "mgwfbp" if exact else "mgwfbp_greedy"
    return result


def dear(workload: Workload, network: CostModel, workers: int, buckets: Buckets | None = None) -> Result:
    """Steady state of DeAR ([DeAR] §III): the iteration starts once every reduce-scatter is done;
    all-gathers are issued at once, first-needed first, each layer's forward waits for its bucket's;
    then backward with reduce-scatters FIFO as buckets fill."""
    buckets = per_layer(workload) if buckets is None else buckets
    bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket}
    gathered: dict[int, float] = {}
    spans: list[Span] = []
    link_free = 0.0
    for b in reversed(range(len(buckets))):
        start = link_free
        link_free = start + network.time("all_gather", bytes_of_bucket(workload, buckets[b]), workers)
        gathered[b] = link_free
        spans.append(Span("link", f"all_gather b{b}", start, link_free))
    clock = 0.0
    for i, layer in enumerate(workload.layers):
        start = max(clock, gathered.get(bucket_of.get(i, -1), 0.0))
        clock = start + layer.forward_s
        spans.append(Span("compute", f"F {layer.name}", start, clock))
    # every layer waited for its bucket's all-gather, so the link is idle when backward starts
    backward, t_end = compute_spans(workload, clock, "backward")
    comm, rs_end = _chain(workload, network, workers, buckets, "reduce_scatter", clock)
    return Result("dear", max(t_end, rs_end), spans + backward + comm, len(buckets))


def dear_instance(workload: Workload, network: CostModel, workers: int) -> tuple[DearInstance, list[int]]:
    """The DeAR planning problem for this workload: units are the layers with gradients, in forward order."""
    units = [i for i, layer in enumerate(workload.layers) if layer.nbytes > 0]
    ready = grad_ready(workload)
    suffix, fsuf = 0.0, [0.0] * len(workload.layers)
    for i in reversed(range(len(workload.layers))):
        suffix += workload.layers[i].forward_s
        fsuf[i] = suffix
    instance = DearInstance(
        fsuf=[fsuf[i] for i in units],
        ready=[ready[i] for i in units],
        nbytes=[workload.layers[i].nbytes for i in units],
        reduce_scatter=lambda m: network.time("reduce_scatter", m, workers),
        all_gather=lambda m: network.time("all_gather", m, workers),
        t_ff=workload.forward_s,
        t_bp=workload.backward_s,
    )
    return instance, units


def dear_model_buckets(workload: Workload, network: CostModel, workers: int) -> tuple[list[list[int]], DearPlan]:
    instance, units = dear_instance(workload, network, workers)
    plan = plan_dear_model(instance)
    return [sorted((units[u] for u in group), reverse=True) for group in reversed(plan.groups)], plan
