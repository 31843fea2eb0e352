"""A bucket's units on several streams (`commsched.streams`): each unit all-reduced (wfbp), reduced
node first (wfbp, two-level), or reduce-scattered and all-gathered (DeAR) on its own stream.

Every unit is requested on the training thread in unit order, so each stream's link issues its
units in the same order on every rank; the streams run at once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from commsched.comm.buckets import Bucket
from commsched.comm.links import Link, Pending
from commsched.reducers.allreduce import AllReduce
from commsched.reducers.base import Reducer
from commsched.reducers.hierarchical import HierarchicalReduce
from commsched.reducers.sharded import ShardedReduce
from commsched.reducers.staging import Staging
from commsched.reducers.units import Unit


class Together:
    """Several collectives in flight as one: done when all are."""

    def __init__(self, pending: Sequence[Pending]) -> None:
        self.pending = list(pending)

    def wait(self, exposed: bool = True) -> None:
        for p in self.pending:
            p.wait(exposed)

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self.pending)


def unit_bucket(bucket: Bucket, unit: Unit, world: int) -> Bucket:
    """A unit as a bucket of no parameters (the two-level reducer's input; it keeps no state when dense)."""
    return Bucket(
        bucket.index, [], [], bucket.buffer.narrow(0, unit.start, unit.numel), [], unit.numel, unit.numel // world
    )


class StripedAllReduce(Reducer):
    """wfbp's dense exchange of one bucket, unit by unit: flat (one all-reduce per unit) or two-level."""

    def __init__(
        self,
        bucket: Bucket,
        units: list[Unit],
        flat: Sequence[Link],
        two_level: Optional[tuple[Sequence[Link], Sequence[Link]]] = None,
    ) -> None:
        """`flat`: the primary's streams; `two_level`: the intra- and inter-node links' streams (then used instead)."""
        self.units = units
        if two_level is not None:
            intra, inter = two_level
            world = intra[0].world_size * inter[0].world_size
            self._parts: list = [
                HierarchicalReduce(unit_bucket(bucket, u, world), intra[u.stream], inter[u.stream]) for u in units
            ]
        else:
            staging = Staging(bucket.buffer, flat[0])
            self._parts = [AllReduce(bucket.buffer, flat[u.stream], staging) for u in units]

    def start(self, tag: str) -> Together:
        if isinstance(self._parts[0], HierarchicalReduce):
            return Together([part.start(u.tag) for part, u in zip(self._parts, self.units)])
        return Together([part.start(u.tag, u.start, u.numel) for part, u in zip(self._parts, self.units)])


class StripedShards(Reducer):
    """DeAR's two halves of one bucket, unit by unit: each unit reduce-scattered on its stream in
    backward and all-gathered there in the next forward. This rank owns its shard of every unit."""

    def __init__(self, bucket: Bucket, units: list[Unit], streams: Sequence[Link]) -> None:
        self.units = units
        self.links = [streams[u.stream] for u in units]
        self.parts = [
            ShardedReduce(bucket.buffer.narrow(0, u.start, u.numel), link) for u, link in zip(units, self.links)
        ]

    def scatter(self, tag: str) -> Together:
        return Together([part.scatter(u.tag) for part, u in zip(self.parts, self.units)])

    def gather_unit(self, i: int, after: list[Pending]) -> Pending:
        return self.parts[i].gather(self.units[i].tag, after=after)

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """(offset in the bucket, reduced values) of this rank's shard of each unit."""
        pieces = []
        for unit, part, link in zip(self.units, self.parts, self.links):
            pieces.append((unit.start + link.rank * (unit.numel // link.world_size), part.shard))
        return pieces
