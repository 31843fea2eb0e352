"""A schedule added from outside the package, as a contributor would: WFBP whose reducers also keep,
per rank, the running sum of this rank's own (unreduced) gradients -- the shape of an
error-feedback residual.

It exercises the engine's extension points: the registry (`commsched.register_schedule`), a
reducer that owns per-rank state by parameter name (saved per rank in checkpoints, carried across
bucket rebuilds, refused at another world size or by a run whose reducers do not keep it).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from typing_extensions import override

import commsched
from commsched.reducers import AllReduce, ReducerState, by_parameter, into_bucket


class LocalSumAllReduce(AllReduce):
    kinds = ("local_sum",)

    def __init__(self, bucket: Any, link: Any) -> None:
        super().__init__(bucket.buffer, link)
        self.bucket = bucket
        self.total = torch.zeros_like(bucket.buffer)

    def start(self, tag: str, start: int = 0, numel: Any = None):
        self.total.add_(
            self.bucket.buffer, alpha=self.link.world_size
        )  # this rank's gradient / P, before the all-reduce
        return super().start(tag, start, numel)

    def state_dict(self) -> ReducerState:
        return {"local_sum": by_parameter(self.bucket, self.total)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        into_bucket(self.bucket, state.get("local_sum", {}), self.total)


@commsched.register_schedule
class LocalSumWFBP(commsched.SCHEDULES["wfbp"]):
    name = "localsum"
    description = "test schedule: wfbp plus a per-rank sum of local gradients"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reducers = [LocalSumAllReduce(bucket, self.link) for bucket in self.plan.buckets]


@commsched.register_schedule
class HierarchicalAllReduce(commsched.Schedule):
    """Each bucket reduced in three stages over sub-group links, each stage requested with `after=` the
    one before (the links issue them in order, whatever completes first): a reduce-scatter among the
    node's ranks, an all-reduce of the shard among the ranks with the same local rank on every node,
    an all-gather among the node's ranks. On one node the middle stage is a group of one."""

    name = "hier"
    description = "test schedule: hierarchical all-reduce over the intra- and inter-node links"
    links_used = ("primary", "intra", "inter")
    step_collectives = ("all_reduce",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        intra = self.links["intra"]
        n = intra.world_size
        self._shards = [b.buffer.view(n, -1)[intra.rank] for b in self.plan.buckets]
        self._scratch = [torch.empty(b.buffer.numel() // n * (n - 1)) for b in self.plan.buckets]
        self._done: list[Any] = [None] * len(self.plan.buckets)

    @override
    def on_bucket_ready(self, b: int) -> None:
        intra, inter = self.links["intra"], self.links["inter"]
        full, shard = self.plan.buckets[b].buffer, self._shards[b]
        scattered = intra.reduce_scatter(shard, full, f"bucket{b}", scratch=self._scratch[b])
        reduced = inter.all_reduce(shard, f"bucket{b}", after=scattered)
        self._done[b] = intra.all_gather(full, shard, f"bucket{b}", after=reduced)

    @override
    def on_backward_end(self) -> None:
        for work in self._done:
            work.wait()
        self.hand_back_gradients(range(len(self.plan.buckets)))
