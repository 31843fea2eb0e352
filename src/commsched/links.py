"""A process group plus what every schedule needs around its collectives.

All communication of a schedule goes through one `Link`, so there is a single place that
(a) picks the collective available in the installed torch, (b) turns a failed or timed-out
collective into an error that says which collective and why, and (c) can record the exact
sequence of collectives a rank issued, which tests compare across ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from commsched.errors import PeerFailureError
from commsched.trace import Span

# torch 2.10+ renamed the tensor-in/tensor-out collectives; keep working on torch >= 2.3.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank: enough to prove every rank issued the same sequence."""

    op: str
    tag: str
    numel: int
    dtype: str


class Pending:
    """An in-flight collective; `wait()` re-raises failures as `PeerFailureError` with context.

    `then` runs once, right after the collective completed (e.g. the local sum that turns an
    all-to-all into a reduce-scatter).
    """

    __slots__ = ("_work", "_what", "_then", "_clock")

    def __init__(
        self, work: dist.Work, what: str, then: Optional[Callable[[], object]] = None, clock: Optional["WaitClock"] = None
    ) -> None:
        self._work = work
        self._what = what
        self._then = then
        self._clock = clock

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            self._work.wait()
        except Exception as exc:  # gloo/NCCL raise plain RuntimeError subclasses
            raise PeerFailureError(
                f"commsched: {self._what} failed. A peer process probably died, hung past the "
                f"process-group timeout, or the network link broke. Original error: {exc}"
            ) from exc
        if self._then is not None:
            then, self._then = self._then, None
            then()
        if self._clock is not None:
            self._clock.seconds += time.perf_counter() - started


class WaitClock:
    """Seconds the training loop spent blocked on a link: communication that did not overlap compute."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


class Link:
    """Issues asynchronous collectives on one process group (None = the default group)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, trace: Optional[list[CollectiveRecord]] = None,
                 lane: str = "link") -> None:
        """`trace`: a list to append a record of every collective to (links may share one).
        `lane`: this link's name on a profiler timeline."""
        self.group = group
        self.trace = trace
        self.lane = lane
        self.clock = WaitClock()
        self.spans: Optional[list[Span]] = None  # set by the profiler: launch-to-completion of each collective

    def _pending(self, work: dist.Work, what: str, then: Optional[Callable[[], object]] = None) -> Pending:
        if self.spans is not None:
            spans, lane, start = self.spans, self.lane, time.perf_counter()
            # runs on the backend's thread the moment the collective completes, not when someone waits
            work.get_future().add_done_callback(
                lambda _: spans.append(Span(lane, what.split(" (")[0], start, time.perf_counter())))
        return Pending(work, what, then=then, clock=self.clock)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def _record(self, op: str, tag: str, tensor: torch.Tensor) -> str:
        if self.trace is not None:
            self.trace.append(CollectiveRecord(op, tag, tensor.numel(), str(tensor.dtype)))
        return f"{op} of {tag} ({tensor.numel()} x {tensor.dtype})"

    def all_reduce(self, tensor: torch.Tensor, tag: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
        what = self._record("all_reduce", tag, tensor)
        return self._pending(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), what)

    @property
    def native_reduce_scatter(self) -> bool:
        """gloo's reduce-scatter costs a whole all-reduce (measured: 12 MB at 1 Gbit, 208 ms vs 203 ms
        all-reduce vs 102 ms all-gather); an all-to-all plus a local sum moves half the bytes."""
        return dist.get_backend(self.group) != "gloo"

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, tag: str, scratch: Optional[torch.Tensor] = None
    ) -> Pending:
        """Sum `full` over ranks and leave this rank's slice in `shard`.

        `scratch` (same size as `full`) receives the other ranks' slices when the backend has no
        efficient reduce-scatter; callers allocate it once.
        """
        what = self._record("reduce_scatter", tag, full)
        if self.native_reduce_scatter:
            return self._pending(_reduce_scatter_single(shard, full, group=self.group, async_op=True), what)
        if scratch is None:
            raise ValueError("commsched: reduce_scatter over gloo needs a scratch tensor the size of `full`")
        work = dist.all_to_all_single(scratch, full, group=self.group, async_op=True)
        return self._pending(work, what, then=partial(torch.sum, scratch.view(self.world_size, -1), 0, out=shard))

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, tag: str) -> Pending:
        what = self._record("all_gather", tag, full)
        return self._pending(_all_gather_single(full, shard, group=self.group, async_op=True), what)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str) -> Pending:
        what = self._record("broadcast", tag, tensor)
        return self._pending(dist.broadcast(tensor, src=src, group=self.group, async_op=True), what)

    def all_gather_int(self, value: int, tag: str) -> list[int]:
        """Blocking all-gather of one int64 per rank (plan hashes, decisions)."""
        mine = torch.tensor([value], dtype=torch.int64)
        everyone = torch.empty(self.world_size, dtype=torch.int64)
        self.all_gather(everyone, mine, tag).wait()
        return everyone.tolist()

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int, tag: str) -> None:
        """Blocking broadcast of many tensors from `src` as one message of their bytes, whatever their dtypes."""
        if not tensors:
            return
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
            self.broadcast(flat, src, tag).wait()
            offset = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                # clone: an aligned, contiguous copy that can be reinterpreted as t's dtype (t may be
                # channels_last or otherwise strided, so it is filled by copy_, not by a view)
                t.copy_(flat[offset : offset + n].clone().view(t.dtype).view(t.shape))
                offset += n
