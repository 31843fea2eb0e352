"""Compressed and two-level exchanges on the simulator's timeline ([Cloud-TopK] §3.2).

Each bucket's exchange starts when its last gradient is ready (wfbp's overlap) and runs on one
FIFO link lane, stage after stage. A rank sends k = ceil(density * elements) float32 values and k
int32 indices, 8k bytes, plus the values of the one-dimensional parameters, sent whole
(`Layer.whole_nbytes`; k counts the other elements), gathered by all P (flat) or by the m nodes of
its local rank (two-level, a 1/n shard of each).
On m nodes of n workers the node stages use `intra` (NVLink-like), the middle stage `inter`:
- topk:       all-gather of 8k bytes per rank among P (one node's view: everyone over `inter`);
- hitopk:     intra reduce-scatter, all-gather of 8k' bytes (k' of the 1/n shard) among m, intra all-gather;
- hier_dense: intra reduce-scatter, all-reduce of the shard among m, intra all-gather (2D-torus style).
Selection time (MSTopK: a few passes over the bucket) is left out, as the paper measures it negligible.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Buckets, Result, bytes_of_bucket, compute_spans, grad_ready, per_layer
from commsched.sim.workload import Workload
from commsched.trace import Span

FLOAT = 4


def sent_bytes(nbytes: float, density: float, whole_nbytes: float = 0.0) -> float:
    """What one rank sends for a piece of `nbytes` (float32 gradients) of which `whole_nbytes` belong to
    one-dimensional parameters: k values and k int32 indices of the rest, and those values whole."""
    elements = (nbytes - whole_nbytes) / FLOAT
    k = min(elements, max(1.0, math.ceil(density * elements))) if elements else 0
    return 2 * FLOAT * k + whole_nbytes


def _whole_bytes(workload: Workload, bucket: Sequence[int]) -> int:
    return sum(workload.layers[i].whole_nbytes for i in bucket)


def nodes_of(workers: int, per_node: int) -> tuple[int, int]:
    """(m nodes, n workers per node): fewer workers than a node holds make one node."""
    n = min(per_node, workers)
    return max(1, workers // n), n


def _overlapped(name: str, workload: Workload, buckets: Buckets, cost: Callable[[float, float], float]) -> Result:
    """`cost(nbytes, whole_nbytes)` of each bucket's exchange, started when it is ready, FIFO on one lane."""
    forward, t_ff = compute_spans(workload, 0.0, "forward")
    backward, t_end = compute_spans(workload, t_ff, "backward")
    ready = grad_ready(workload, t_ff)
    spans, link_free = [], t_ff
    for index, bucket in enumerate(buckets):
        start = max(link_free, max(ready[i] for i in bucket))
        link_free = start + cost(bytes_of_bucket(workload, bucket), _whole_bytes(workload, bucket))
        spans.append(Span("link", f"{name} b{index}", start, link_free))
    return Result(name, max(t_end, link_free), forward + backward + spans, len(buckets))


def topk(workload: Workload, inter: CostModel, workers: int, density: float, buckets: Buckets | None = None) -> Result:
    buckets = per_layer(workload) if buckets is None else buckets
    return _overlapped(
        "topk",
        workload,
        buckets,
        lambda nbytes, whole: inter.time("all_gather", workers * sent_bytes(nbytes, density, whole), workers),
    )


def hitopk(
    workload: Workload,
    inter: CostModel,
    intra: CostModel,
    workers: int,
    per_node: int,
    density: float,
    buckets: Buckets | None = None,
) -> Result:
    m, n = nodes_of(workers, per_node)
    buckets = per_layer(workload) if buckets is None else buckets

    def cost(nbytes: float, whole: float) -> float:
        return (
            intra.time("reduce_scatter", nbytes, n)
            + inter.time("all_gather", m * sent_bytes(nbytes / n, density, whole / n), m)
            + intra.time("all_gather", nbytes, n)
        )

    return _overlapped("hitopk", workload, buckets, cost)


def hier_dense(
    workload: Workload, inter: CostModel, intra: CostModel, workers: int, per_node: int, buckets: Buckets | None = None
) -> Result:
    m, n = nodes_of(workers, per_node)
    buckets = per_layer(workload) if buckets is None else buckets

    def cost(nbytes: float, whole: float) -> float:
        return (
            intra.time("reduce_scatter", nbytes, n)
            + inter.time("all_reduce", nbytes / n, m)
            + intra.time("all_gather", nbytes, n)
        )

    return _overlapped("hier_dense", workload, buckets, cost)
