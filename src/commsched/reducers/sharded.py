"""A bucket reduced in two collectives the schedule starts at different times (DeAR).

`scatter` leaves this rank's slice of the summed bucket in `shard` (reduce-scatter; on gloo an
all-to-all plus a local sum, run as a continuation when the all-to-all completes); `gather`
puts every rank's shard back into the whole bucket (all-gather). Between the two, the schedule
can read and scale the shard (clipping on reduced shards).
"""

from __future__ import annotations

import torch

from commsched.links import Link, Pending
from commsched.reducers.staging import Staging


class ShardedReduce:
    def __init__(self, buffer: torch.Tensor, link: Link) -> None:
        self.link = link
        self._staging = Staging(buffer, link)
        world = link.world_size
        self.shard = torch.zeros(buffer.numel() // world, dtype=buffer.dtype, device=link.device)
        # gloo: the other ranks' slices land here before the local sum (one extra gradient copy)
        self._scratch = None if link.native_reduce_scatter else torch.empty_like(self._staging.tensor)

    def scatter(self, tag: str) -> Pending:
        self._staging.to_link()
        return self.link.reduce_scatter(self.shard, self._staging.tensor, tag, scratch=self._scratch)

    def gather(self, tag: str) -> Pending:
        pending = self.link.all_gather(self._staging.tensor, self.shard, tag)
        return pending.then(self._staging.from_link) if self._staging.tensor is not self._staging.buffer else pending
