"""A bucket reduced in two collectives the schedule starts at different times (DeAR).

`scatter` leaves this rank's slice of the summed bucket in `shard` (reduce-scatter; on gloo
point-to-point exchanges plus a local sum, run as a continuation when they complete, with the
shard being the bucket's own slice); `gather` puts every rank's shard back into the whole bucket
(all-gather), issued after `after` completes when it is one of a chain. Between the two, the
schedule can read the shard (the global norm for clipping).
"""

from __future__ import annotations

from typing import Optional

import torch

from commsched.comm.links import Link, Pending
from commsched.reducers.base import Reducer
from commsched.reducers.staging import Staging


class ShardedReduce(Reducer):
    def __init__(self, buffer: torch.Tensor, link: Link, cast: bool = True) -> None:
        """`cast`: False keeps the bucket's dtype on the wire (`Staging`)."""
        self.link = link
        self._staging = Staging(buffer, link, cast)
        world, full = link.world_size, self._staging.tensor
        if link.native_reduce_scatter:
            self.shard = torch.zeros(full.numel() // world, dtype=full.dtype, device=link.device)
            self._scratch = None
        else:  # gloo: the shard is this rank's own slice of the bucket, the others' slices land in scratch
            self.shard = full.view(world, -1)[link.rank]
            self._scratch = torch.empty(full.numel() // world * (world - 1), dtype=full.dtype, device=link.device)

    def scatter(self, tag: str) -> Pending:
        ready = self._staging.to_link()
        return self.link.reduce_scatter(self.shard, self._staging.tensor, tag, scratch=self._scratch, ready=ready)

    def gather(self, tag: str, after: Optional[Pending] = None) -> Pending:
        pending = self.link.all_gather(self._staging.tensor, self.shard, tag, after=after)
        return pending.then(self._staging.from_link) if self._staging.staged else pending
