"""A bucket reduced as a sparse top-k exchange ([cloud-topk] §3.2, one node): each rank selects k
elements of its bucket, every rank gathers every rank's (values, indices) and adds them into a
zeroed bucket. The capture scaled the gradients by 1/P, so the sum is the average of what was sent.

Error feedback (the paper cites DGC for it and does not specify it): what this rank did not send
stays in its residual, in the bucket's units (gradient / P), and is added to the bucket before the
next selection, so applied + residual always sums to the dense gradients. Under torch's SGD, DGC's
corrections run first (`commsched.compression.dgc`): clipping and weight decay on the rank's
gradient, then its velocity takes the gradient's place; where a coordinate is selected its velocity
is cleared too (the one-dimensional parameters, sent whole every step, keep theirs: for them the
exchange is dense). Residuals and velocities are this rank's communication state, saved by
parameter name (`reducers.base`).

Values and indices travel in one all-gather: the values in the wire dtype (`comm_dtype`) and int32
indices side by side, the indices reinterpreted bit for bit as one float32 or two 16-bit elements (one
latency instead of two on a slow link; an index is never rounded). The
elements of one-dimensional parameters are always sent, beside the k selected among the others
(`commsched.compression.whole_vectors`: ranked with the rest they starve).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional

import torch

from commsched.comm.buckets import Bucket
from commsched.comm.links import Link, Pending
from commsched.compression.dgc import Corrections
from commsched.compression.whole_vectors import Selector, WholeVectors
from commsched.reducers.base import Reducer, ReducerState, by_parameter, into_bucket
from commsched.reducers.dense import AllReduce


def k_of(density: float, numel: int) -> int:
    """Elements a rank sends for a bucket of `numel`: at least one, at most all."""
    return min(numel, max(1, math.ceil(density * numel))) if numel else 0


class SparsePacket:
    """One rank's selection and every rank's, in the layout one all-gather carries: the k selected values
    in the wire dtype, their int32 indices bit-cast to it, then the values of the window's
    one-dimensional parameters (`WholeVectors`), whose positions every rank of the exchange already
    knows, so they travel without indices. Shared by the flat and the two-level exchange."""

    def __init__(self, density: float, window: WholeVectors, link: Link) -> None:
        self.window = window
        self.density = density
        self.k = k_of(density, window.ranked_numel)
        self.dtype = link.wire_dtype
        self.index_slots = 4 // torch.tensor([], dtype=self.dtype).element_size()  # an int32 in wire elements
        self.width = (1 + self.index_slots) * self.k + window.whole_numel
        self.world_size = link.world_size
        self.mine = torch.empty(self.width, dtype=self.dtype, device=link.device)
        self.everyone = torch.empty(link.world_size * self.width, dtype=self.dtype, device=link.device)

    def at_density(self, density: float, link: Link) -> "SparsePacket":
        """This packet, or a new one for another density (a sparsity warm-up's next stage)."""
        return self if density == self.density else SparsePacket(density, self.window, link)

    def select(self, x: torch.Tensor, select: Selector, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Pack what `x` sends; what is not sent stays in `residual` (error feedback). Returns the
        positions selected (window-relative; not those of the one-dimensional parameters, always sent)."""
        values, indices = self.window.select(x, select, self.k)
        if residual is not None:
            residual.copy_(x)
            residual[indices] = 0.0
        k, end = self.k, (1 + self.index_slots) * self.k
        self.mine[:k].copy_(values[:k])
        self.mine[k:end].copy_(indices[:k].to(torch.int32).view(self.dtype))
        self.mine[end:].copy_(values[k:])
        return indices[:k]

    def add_everyones(self, target: torch.Tensor) -> None:
        """`target` becomes the sum of what every rank sent (zeros elsewhere)."""
        sent = self.everyone.view(self.world_size, self.width).to(target.device)
        k, end = self.k, (1 + self.index_slots) * self.k
        values = sent[:, :k].reshape(-1).to(target.dtype)
        indices = sent[:, k:end].contiguous().view(torch.int32).reshape(-1).to(torch.int64)
        target.zero_().index_add_(0, indices, values)
        if self.window.whole_numel:
            target[self.window.whole] = sent[:, end:].to(target.dtype).sum(0)


class SparseExchange:
    """The all-gather in flight; `wait` adds what every rank sent into the zeroed bucket."""

    def __init__(self, pending: Pending, finish: Callable[[], None]) -> None:
        self._pending = pending
        self._finish = finish

    def wait(self) -> None:
        self._pending.wait()
        self._finish()


class TopKAllReduce(Reducer):
    def __init__(
        self,
        bucket: Bucket,
        link: Link,
        density: float,
        select: Selector,
        error_feedback: bool = True,
        whole_vectors: bool = True,
        corrections: Optional[Corrections] = None,
    ) -> None:
        if bucket.buffer.dtype != torch.float32:
            raise TypeError(
                "commsched compression: sparse exchanges carry float32 gradients, "
                f"this bucket holds {bucket.buffer.dtype}"
            )
        self.bucket = bucket
        self.link = link
        self._select = select
        self.residual: Optional[torch.Tensor] = torch.zeros_like(bucket.buffer) if error_feedback else None
        self._local = corrections.local(bucket, link.world_size) if corrections is not None else None
        self.velocity = (
            corrections.velocity(bucket, 0, bucket.buffer.numel())
            if corrections is not None and error_feedback
            else None
        )
        self._masking = corrections is not None and corrections.masking
        self.kinds = (("residual",) if error_feedback else ()) + (("momentum",) if self.velocity is not None else ())
        self._packet = SparsePacket(density, WholeVectors(bucket, 0, bucket.buffer.numel(), whole_vectors), link)
        self.dense = False
        """A dense phase (`CompressionOptions.dense_warmup_steps`, `dense_final_steps`, a sparsity warm-up's
        dense stages): all-reduce the bucket, the residual added to it once and emptied; under momentum
        correction the velocity is what is all-reduced, unmasked (momentum is linear: this is SGD with
        momentum on the averaged gradient)."""
        self._dense = AllReduce(bucket.buffer, link)

    def set_density(self, density: float) -> None:
        self._packet = self._packet.at_density(density, self.link)

    def start(self, tag: str) -> SparseExchange | Pending:
        buffer = self.bucket.buffer
        if self._local is not None:
            self._local.apply()
        if self.velocity is not None:
            self.velocity.accumulate(buffer)
        if self.residual is not None:
            buffer.add_(self.residual)
        if self.dense:
            if self.residual is not None:
                self.residual.zero_()
            return self._dense.start(tag)
        sent = self._packet.select(buffer, self._select, self.residual)
        if self.velocity is not None and self._masking:
            self.velocity.mask(sent)
        pending = self.link.all_gather(self._packet.everyone, self._packet.mine, tag)
        return SparseExchange(pending, lambda: self._packet.add_everyones(buffer))

    def state_dict(self) -> ReducerState:
        state = {"residual": by_parameter(self.bucket, self.residual)} if self.residual is not None else {}
        if self.velocity is not None and self.velocity.u.any():  # none under optimizers without momentum
            state["momentum"] = by_parameter(self.bucket, self.velocity.u)
        return state

    def live_state(self) -> list[torch.Tensor]:
        return [t for t in (self.residual, self.velocity.u if self.velocity is not None else None) if t is not None]

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        if self.residual is not None:
            into_bucket(self.bucket, state.get("residual", {}), self.residual)
        if self.velocity is not None:
            into_bucket(self.bucket, state.get("momentum", {}), self.velocity.u)

    def load_total(self, totals: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Every old rank's residuals and velocities summed, by kind (a resume at another world size):
        each rank takes 1/P of each."""
        for kind, kept in (
            ("residual", self.residual),
            ("momentum", self.velocity.u if self.velocity is not None else None),
        ):
            if kept is not None:
                into_bucket(self.bucket, totals.get(kind, {}), kept)
                kept.div_(self.link.world_size)
