"""A bucket reduced in two levels, node first ([cloud-topk] §3.2, HiTopKComm).

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

DGC's corrections (`commsched.compression.dgc`) split the same way: clipping and weight decay on the
rank's own bucket before the reduce-scatter, the velocity on the shard (the node's sum: momentum is
linear, so one velocity per shard is the sum of the node's ranks' velocities), kept like the residual.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from commsched.comm.buckets import Bucket
from commsched.comm.links import Link, Pending
from commsched.compression.dgc import Corrections
from commsched.compression.whole_vectors import Selector, WholeVectors
from commsched.reducers.base import Reducer, ReducerState, by_parameter, into_bucket
from commsched.reducers.dense import ShardedReduce, Together
from commsched.reducers.topk import SparsePacket
from commsched.reducers.units import Unit


class HierarchicalReduce(Reducer):
    def __init__(
        self,
        bucket: Bucket,
        intra: Link,
        inter: Link,
        density: Optional[float] = None,
        select: Optional[Selector] = None,
        error_feedback: bool = True,
        whole_vectors: bool = True,
        corrections: Optional[Corrections] = None,
    ) -> None:
        """`density` None: the dense two-level all-reduce; else HiTopKComm with `select`."""
        self.bucket = bucket
        self.intra, self.inter = intra, inter
        # sparse: the node's stages stay in the bucket's dtype (the residual and the selection work on the
        # shard), and only what crosses the slow network takes the wire dtype (the packet)
        self._node = ShardedReduce(bucket.buffer, intra, cast=density is None)
        shard = self._node.shard
        self.sparse = density is not None
        self.residual: Optional[torch.Tensor] = torch.zeros_like(shard) if self.sparse and error_feedback else None
        corrections = corrections if self.sparse else None
        self._local = (
            corrections.local(bucket, intra.world_size * inter.world_size) if corrections is not None else None
        )
        start = intra.rank * shard.numel()
        self.velocity = (
            corrections.velocity(bucket, start, shard.numel()) if corrections is not None and error_feedback else None
        )
        self._masking = corrections is not None and corrections.masking
        self.kinds: tuple[str, ...] = (("residual",) if self.residual is not None else ()) + (
            ("momentum",) if self.velocity is not None else ()
        )
        if self.sparse:
            assert select is not None and density is not None
            self._select = select
            window = WholeVectors(bucket, start, shard.numel(), whole_vectors)
            self._packet = SparsePacket(density, window, inter)
        self.dense = False
        """A dense phase of a sparse exchange: the shard all-reduced across nodes, the residual added once
        (under momentum correction the shard's velocity, unmasked)."""

    def set_density(self, density: float) -> None:
        self._packet = self._packet.at_density(density, self.inter)

    def start(self, tag: str) -> Pending:
        if self._local is not None:
            self._local.apply()
        scattered = self._node.scatter(tag)
        if self.sparse and self.dense:
            if self.residual is not None:
                scattered.then(self._empty_residual_into_shard)
            across = self.inter.all_reduce(self._node.shard, tag, after=scattered)
        elif self.sparse:
            scattered.then(self._select_from_shard)
            across = self.inter.all_gather(self._packet.everyone, self._packet.mine, tag, after=scattered).then(
                lambda: self._packet.add_everyones(self._node.shard)
            )
        else:
            across = self.inter.all_reduce(self._node.shard, tag, after=scattered)
        return self._node.gather(tag, after=across)

    def _empty_residual_into_shard(self) -> None:
        assert self.residual is not None
        if self.velocity is not None:
            self.velocity.accumulate(self._node.shard)
        self._node.shard.add_(self.residual)
        self.residual.zero_()

    def _select_from_shard(self) -> None:
        shard = self._node.shard
        if self.velocity is not None:
            self.velocity.accumulate(shard)
        if self.residual is not None:
            shard.add_(self.residual)
        sent = self._packet.select(shard, self._select, self.residual)
        if self.velocity is not None and self._masking:
            self.velocity.mask(sent)

    def _kept(self) -> dict[str, torch.Tensor]:
        """The per-shard state by kind."""
        kept = {"residual": self.residual} if self.residual is not None else {}
        if self.velocity is not None:
            kept["momentum"] = self.velocity.u
        return kept

    def live_state(self) -> list[torch.Tensor]:
        return list(self._kept().values())

    def state_dict(self) -> ReducerState:
        kept = {
            kind: shard for kind, shard in self._kept().items() if kind != "momentum" or shard.any()
        }  # no velocity without momentum
        return {kind: by_parameter(self.bucket, self._whole(shard)) for kind, shard in kept.items()}

    def _whole(self, shard: torch.Tensor) -> torch.Tensor:
        """`shard` placed at this rank's shard of a bucket-sized tensor."""
        whole = torch.zeros_like(self.bucket.buffer)
        whole.view(self.intra.world_size, -1)[self.intra.rank].copy_(shard)
        return whole

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for kind, shard in self._kept().items():
            self._load_whole(state.get(kind, {}), shard, 1)

    def load_total(self, totals: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Every old rank's residuals and velocities summed, by kind (a resume at another world size): a
        shard's state is owed once per node, so each rank takes its shard of the sum over the number of nodes."""
        for kind, shard in self._kept().items():
            self._load_whole(totals.get(kind, {}), shard, self.inter.world_size)

    def _load_whole(self, saved: Mapping[str, torch.Tensor], shard: torch.Tensor, share: int) -> None:
        whole = torch.zeros_like(self.bucket.buffer)
        into_bucket(self.bucket, saved, whole)
        shard.copy_(whole.view(self.intra.world_size, -1)[self.intra.rank]).div_(share)


def unit_bucket(bucket: Bucket, unit: Unit, world: int) -> Bucket:
    """A unit as a bucket of no parameters (the two-level reducer's input; it keeps no state when dense)."""
    return Bucket(
        bucket.index, [], [], bucket.buffer.narrow(0, unit.start, unit.numel), [], unit.numel, unit.numel // world
    )


class StripedTwoLevel(Reducer):
    """wfbp's dense exchange of one bucket on several nodes, unit by unit: each unit reduced node first on
    its stream of the intra- and inter-node links."""

    def __init__(self, bucket: Bucket, units: list[Unit], intra: Sequence[Link], inter: Sequence[Link]) -> None:
        self.units = units
        world = intra[0].world_size * inter[0].world_size
        self._parts = [
            HierarchicalReduce(unit_bucket(bucket, u, world), intra[u.stream], inter[u.stream]) for u in units
        ]

    def start(self, tag: str) -> Together:
        return Together([part.start(u.tag) for part, u in zip(self._parts, self.units)])
