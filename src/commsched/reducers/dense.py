"""A bucket's dense exchange: summed whole in one all-reduce (wfbp, DeFT), or in two halves the
schedule starts at different times (DeAR: a reduce-scatter in backward, an all-gather in the next
forward), whole or unit by unit on several streams (`commsched.streams`); in the link's dtype and
on its device.

**Staging.** A bucket's bytes as the link carries them: on its device (gloo links carry CPU
tensors even when the model is on a GPU) and in its wire dtype (`comm_dtype`: fp32 gradients cast
to bf16 or fp16 on the way out, cast back on the way in, as DDP's compress hooks do). The host copy
is pinned and both copies are asynchronous: `to_link` enqueues the device-to-host copy on the
model's stream and returns an event the link waits for before issuing the collective (in its own
queue: the training thread does not wait); `from_link`, run on the backend's completion thread,
enqueues the host-to-device copy on the model's stream, so everything the training loop enqueues
after waiting for the collective sees the result. On one device both are no-ops: the collective
works on the bucket itself.

**All-reduce.** The capture scaled the gradients by 1/P while copying them into the bucket, as DDP
does, so the sum is the average.

**Two halves.** `scatter` leaves this rank's slice of the summed bucket in `shard` (reduce-scatter;
on gloo point-to-point exchanges plus a local sum, run as a continuation when they complete, with
the shard being the bucket's own slice); `gather` puts every rank's shard back into the whole
bucket (all-gather), issued after `after` completes when it is one of a chain. Between the two, the
schedule can read the shard (the global norm for clipping).

**Units.** Every unit is requested on the training thread in unit order, so each stream's link
issues its units in the same order on every rank; the streams run at once. (The two-level exchange
by units is `reducers.hierarchical`'s.)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from commsched.comm.buckets import Bucket
from commsched.comm.links import Link, Pending
from commsched.reducers.base import Reducer
from commsched.reducers.units import Unit


class Staging:
    """Either the bucket buffer itself (same device and dtype) or a copy that collectives use instead
    (pinned host memory for a CUDA bucket on a gloo link; the wire dtype for a low-precision wire)."""

    def __init__(self, buffer: torch.Tensor, link: Link, cast: bool = True) -> None:
        """`cast`: False keeps the buffer's dtype on the wire (a stage whose result is worked on, not only sent)."""
        self.buffer = buffer
        self.device = link.device
        self._copy: Optional[torch.Tensor] = None
        self._stream: Any = None
        wire = link.wire_for(buffer.dtype) if cast else buffer.dtype
        if buffer.device != self.device or wire != buffer.dtype:
            moved = buffer.device != self.device and buffer.device.type == "cuda"
            self._copy = torch.empty(buffer.shape, dtype=wire, device=self.device, pin_memory=moved)
            self._stream = torch.cuda.current_stream(buffer.device) if moved else None  # read on the training thread

    @property
    def tensor(self) -> torch.Tensor:
        """What the collective touches."""
        return self._copy if self._copy is not None else self.buffer

    @property
    def staged(self) -> bool:
        return self._copy is not None

    def to_link(self, start: int = 0, numel: Optional[int] = None) -> Any:
        """Copy (a slice of) the bucket to the link's device; returns the CUDA event to wait for, or None."""
        if self._copy is None:
            return None
        numel = self.buffer.numel() - start if numel is None else numel
        self._copy.narrow(0, start, numel).copy_(
            self.buffer.narrow(0, start, numel), non_blocking=self._stream is not None
        )
        if self._stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record(self._stream)
        return ready

    def from_link(self, start: int = 0, numel: Optional[int] = None) -> None:
        """Copy (a slice of) the result back to the bucket (on the completion thread: on the model's stream)."""
        if self._copy is None:
            return
        numel = self.buffer.numel() - start if numel is None else numel
        source, target = self._copy.narrow(0, start, numel), self.buffer.narrow(0, start, numel)
        if self._stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)


class AllReduce(Reducer):
    """One bucket (or a piece of it) summed over all ranks in one collective."""

    def __init__(self, buffer: torch.Tensor, link: Link, staging: Optional[Staging] = None) -> None:
        """`staging`: shared with the bucket's other reducers (streams of one link spec: one host copy)."""
        self.link = link
        self._staging = staging if staging is not None else Staging(buffer, link)

    def start(self, tag: str, start: int = 0, numel: Optional[int] = None) -> Pending:
        """Sum (elements `start..start+numel` of) the bucket over ranks; the result is in the bucket
        when the returned `Pending` completes."""
        numel = self._staging.buffer.numel() - start if numel is None else numel
        ready = self._staging.to_link(start, numel)
        pending = self.link.all_reduce(self._staging.tensor.narrow(0, start, numel), tag, ready=ready)
        if self._staging.staged:
            pending.then(lambda: self._staging.from_link(start, numel))
        return pending


class ShardedReduce(Reducer):
    """A bucket reduced in two collectives the schedule starts at different times."""

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


class Together:
    """Several collectives in flight as one: done when all are."""

    def __init__(self, pending: Sequence[Pending]) -> None:
        self.pending = list(pending)

    def wait(self, exposed: bool = True) -> None:
        for p in self.pending:
            p.wait(exposed)

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self.pending)


class StripedAllReduce(Reducer):
    """wfbp's dense exchange of one bucket, unit by unit: one all-reduce per unit on its stream."""

    def __init__(self, bucket: Bucket, units: list[Unit], streams: Sequence[Link]) -> None:
        """`streams`: the primary's streams (one host copy shared by the units: one link spec)."""
        self.units = units
        staging = Staging(bucket.buffer, streams[0])
        self._parts = [AllReduce(bucket.buffer, streams[u.stream], staging) for u in units]

    def start(self, tag: str) -> Together:
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
