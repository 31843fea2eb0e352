"""A bucket reduced in two levels, node first ([cloud-topk] §3.2, HiTopKComm; DESIGN.md §9).

On m nodes of n workers: (1) a reduce-scatter among the node's n ranks (fast links) leaves each
worker the node's sum of one n-th of the bucket, its shard; (2) the shard is combined across nodes
among the m ranks of the same local rank, over the slow network: densely by an all-reduce (the
paper's strong 2D baseline), or sparsely: MSTopK on the shard plus its residual, an all-gather of
(values, indices) and a scatter-add into the zeroed shard; (3) an all-gather among the node's ranks
puts every shard back into the bucket. The capture scaled by 1/P: the result is the average.

Every stage is requested on the training thread when the bucket is ready, each `after=` the one
before, so each link issues them in the same order on every rank; the selection and the
scatter-add run as continuations of the stage they follow. The residual lives on the shard (where
the selection happens) and is kept by parameter name over the whole bucket (zeros outside the
shard), so a checkpoint holds it with every other rank's state.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from commsched.buckets import Bucket
from commsched.compression.whole_vectors import Selector, WholeVectors
from commsched.links import Link, Pending
from commsched.reducers.base import Reducer, ReducerState, by_parameter, into_bucket
from commsched.reducers.sharded import ShardedReduce
from commsched.reducers.topk import SparsePacket


class HierarchicalReduce(Reducer):
    def __init__(self, bucket: Bucket, intra: Link, inter: Link, density: Optional[float] = None,
                 select: Optional[Selector] = None, error_feedback: bool = True, whole_vectors: bool = True) -> None:
        """`density` None: the dense two-level all-reduce; else HiTopKComm with `select`."""
        self.bucket = bucket
        self.intra, self.inter = intra, inter
        self._node = ShardedReduce(bucket.buffer, intra)
        shard = self._node.shard
        self.sparse = density is not None
        self.kinds: tuple[str, ...] = ("residual",) if self.sparse and error_feedback else ()
        self.residual: Optional[torch.Tensor] = torch.zeros_like(shard) if self.kinds else None
        if self.sparse:
            assert select is not None
            self._select = select
            window = WholeVectors(bucket, intra.rank * shard.numel(), shard.numel(), whole_vectors)
            self._packet = SparsePacket(density, window, inter)
        self.dense = False
        """A dense phase of a sparse exchange: the shard all-reduced across nodes, the residual added once."""

    def start(self, tag: str) -> Pending:
        scattered = self._node.scatter(tag)
        if self.sparse and self.dense:
            if self.residual is not None:
                scattered.then(self._empty_residual_into_shard)
            across = self.inter.all_reduce(self._node.shard, tag, after=scattered)
        elif self.sparse:
            scattered.then(self._select_from_shard)
            across = self.inter.all_gather(self._packet.everyone, self._packet.mine, tag, after=scattered).then(
                lambda: self._packet.add_everyones(self._node.shard))
        else:
            across = self.inter.all_reduce(self._node.shard, tag, after=scattered)
        return self._node.gather(tag, after=across)

    def _empty_residual_into_shard(self) -> None:
        assert self.residual is not None
        self._node.shard.add_(self.residual)
        self.residual.zero_()

    def _select_from_shard(self) -> None:
        shard = self._node.shard
        if self.residual is not None:
            shard.add_(self.residual)
        self._packet.select(shard, self._select, self.residual)

    def _whole(self) -> torch.Tensor:
        """The residual placed at this rank's shard of a bucket-sized tensor."""
        whole = torch.zeros_like(self.bucket.buffer)
        assert self.residual is not None
        whole.view(self.intra.world_size, -1)[self.intra.rank].copy_(self.residual)
        return whole

    def state_dict(self) -> ReducerState:
        return {"residual": by_parameter(self.bucket, self._whole())} if self.residual is not None else {}

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self._load_whole(state.get("residual", {}), 1)

    def load_total(self, total: Mapping[str, torch.Tensor]) -> None:
        """Every old rank's residuals summed (a resume at another world size): a shard's residual is
        owed once per node, so each rank takes its shard of the sum over the number of nodes."""
        self._load_whole(total, self.inter.world_size)

    def _load_whole(self, saved: Mapping[str, torch.Tensor], share: int) -> None:
        if self.residual is None:
            return
        whole = torch.zeros_like(self.bucket.buffer)
        into_bucket(self.bucket, saved, whole)
        self.residual.copy_(whole.view(self.intra.world_size, -1)[self.intra.rank]).div_(share)
