"""Gradient capture, the first stage of every schedule: hooks fill bucket buffers, buckets are
handed on in order, missing gradients become zeros, one used-mask per step.

The invariant that keeps ranks in lock-step: every synchronised backward hands each bucket to the
schedule exactly once, in bucket order, then launches one small all-reduce of the "gradient
produced" mask. Buckets are handed on during backward as soon as they and all earlier buckets are
complete; what is left (parameters that got no gradient on this rank) is handed on at the end of
backward, with zeros in place of the missing gradients. The mask tells every rank which
parameters got a gradient on *some* rank, so a parameter unused everywhere keeps `.grad = None`
and the optimizer skips it, exactly as DDP with `find_unused_parameters=True` does.
"""

from __future__ import annotations

import enum
from functools import partial
from typing import Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from commsched.comm.buckets import BucketPlan
from commsched.comm.links import Link, Pending
from commsched.comm.sparse_average import average_sparse
from commsched.errors import ScheduleError
from commsched.hooks import OwnHook


class CapturePhase(enum.Enum):
    IDLE = "idle"  # no gradient of this step seen yet
    COLLECTING = "collecting"  # backward running, buckets filling and handed on
    LAUNCHED = "launched"  # every bucket handed on, the mask in flight


class GradientCapture:
    """Calls `on_bucket(b)` for each complete bucket in order and `on_backward_end()` once per step."""

    def __init__(
        self,
        plan: BucketPlan,
        mask_link: Link,
        schedule_name: str,
        on_bucket: Callable[[int], None],
        on_backward_end: Callable[[], None],
    ) -> None:
        self.plan = plan
        self.sync_enabled = True  # False inside Lightning's no-sync accumulation micro-batches
        self.phase = CapturePhase.IDLE
        self.globally_used: list[list[bool]] = [[True] * len(b.params) for b in plan.buckets]
        self._name = schedule_name
        self._link = mask_link
        self._on_bucket = on_bucket
        self._on_backward_end = on_backward_end
        self._scale = 1.0 / plan.world_size  # DDP divides while copying into the bucket
        self._sizes = [len(b.params) for b in plan.buckets]
        self._remaining = list(self._sizes)
        self._filled = [[False] * n for n in self._sizes]
        self._next = 0
        self._mask = torch.zeros(plan.num_params, device=mask_link.device)
        self._mask_work: Optional[Pending] = None
        self._handles: list[RemovableHandle] = []
        self.idle: frozenset[int] = frozenset()
        """Buckets no rank can fill in the coming backward (`agree_on_idle`): none of their parameters requires
        a gradient or holds one on any rank. They are not handed on (nothing is sent for them) and their
        parameters keep `.grad = None`, which is what DDP leaves in them after averaging their zeros."""

    def divide_by_world_size(self, divide: bool) -> None:
        """Whether gradients are divided by the world size as they are copied in (DDP's average), or left
        summed by nothing for a communication hook that averages them itself."""
        self._scale = 1.0 / self.plan.world_size if divide else 1.0

    def attach(self) -> None:
        for bucket in self.plan.buckets:
            for slot, param in enumerate(bucket.params):
                self._handles.append(
                    param.register_post_accumulate_grad_hook(OwnHook(partial(self._grad_ready, bucket.index, slot)))
                )
        for _, param in self.plan.sparse:
            self._handles.append(param.register_post_accumulate_grad_hook(OwnHook(self._sparse_grad_ready)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def launched(self) -> bool:
        """Every bucket of this backward was handed on: some hook saw a gradient, and the backward has ended."""
        return self.phase is CapturePhase.LAUNCHED

    def filled(self, b: int, slot: int) -> bool:
        return self._filled[b][slot]

    # ------------------------------------------------------------------ backward
    def _grad_ready(self, b: int, slot: int, param: nn.Parameter) -> None:
        if not self.sync_enabled or not param.requires_grad:  # switched off after its forward, before backward
            return
        if self.phase is not CapturePhase.COLLECTING:
            self._begin(in_backward=True)
        if b in self.idle:
            raise ScheduleError(
                f"commsched {self._name}: parameter '{self.plan.buckets[b].names[slot]}' got a gradient in a bucket "
                "every rank agreed idle before this backward (no parameter in it required a gradient then): "
                "requires_grad was switched on after manual_backward started (an on_before_backward hook?). "
                "Switch it before calling manual_backward."
            )
        if self._filled[b][slot]:
            return
        self._fill(b, slot, param)
        self._remaining[b] -= 1
        if b == self._next and self._remaining[b] == 0:
            self._hand_on_in_order()

    def _sparse_grad_ready(self, param: nn.Parameter) -> None:
        """A sparse gradient is averaged at the end of backward; its arrival alone starts the step's
        collection, as a dense one's does (a backward that reaches only an embedding still averages it)."""
        if self.sync_enabled and param.requires_grad and self.phase is not CapturePhase.COLLECTING:
            self._begin(in_backward=True)

    def _fill(self, b: int, slot: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            raise ScheduleError(
                f"commsched {self._name}: parameter '{self.plan.buckets[b].names[slot]}' has no gradient when its "
                "hook runs: another hook took it before commsched's (an optimizer stepped inside backward?). "
                "Gradients must reach every rank before a step; step after backward."
            )
        if grad.is_sparse:
            raise ScheduleError(
                f"commsched: parameter '{self.plan.buckets[b].names[slot]}' has a sparse gradient, and is not the "
                "weight of an nn.Embedding or nn.EmbeddingBag made with sparse=True (whose gradients commsched "
                "averages apart): make its gradient dense, or use strategy='ddp'."
            )
        torch.mul(grad, self._scale, out=self.plan.buckets[b].views[slot])
        self._filled[b][slot] = True
        param.grad = None  # the gradient lives in the bucket now; the schedule hands it back later

    def _begin(self, in_backward: bool) -> None:
        if self.phase is CapturePhase.LAUNCHED:
            raise ScheduleError(
                f"commsched {self._name}: a second backward ran in one optimizer step after the gradients were "
                "already sent. Call backward once per optimizer step (use gradient accumulation instead)."
            )
        self.phase = CapturePhase.COLLECTING
        self._remaining[:] = self._sizes
        for filled in self._filled:
            filled[:] = [False] * len(filled)
        for b in self.idle:
            self._remaining[b] = 0
        self._next = 0
        self._hand_on_in_order()  # past idle buckets at the front: the first busy one goes as soon as it is full
        if in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _hand_on_in_order(self) -> None:
        while self._next < len(self._sizes) and self._remaining[self._next] == 0:
            if self._next not in self.idle:
                self._on_bucket(self._next)
            self._next += 1

    def _finalize(self) -> None:
        """End of backward: hand on what is left, treating gradients that never came as zeros."""
        if self.phase is not CapturePhase.COLLECTING:
            return
        for b in range(self._next, len(self._sizes)):
            if not self._remaining[b]:
                continue
            bucket = self.plan.buckets[b]
            for slot, param in enumerate(bucket.params):
                if self._filled[b][slot]:
                    continue
                if param.grad is not None:  # accumulated on earlier micro-batches, or a step without backward
                    self._fill(b, slot, param)
                else:
                    bucket.views[slot].zero_()
            self._remaining[b] = 0
        self._hand_on_in_order()
        used = [flag for filled in self._filled for flag in filled]
        self._mask.copy_(self._link.tensor(used, self._mask.dtype))
        self._mask_work = self._link.all_reduce(self._mask, "used-mask")
        if self.plan.sparse:  # outside the buckets, averaged as DDP averages them
            self._average_sparse()
        self.phase = CapturePhase.LAUNCHED
        self._on_backward_end()

    def _average_sparse(self) -> None:
        for name, param in self.plan.sparse:
            if param.grad is not None and not param.grad.is_sparse:
                raise ScheduleError(
                    f"commsched {self._name}: parameter '{name}' belongs to an embedding made with sparse=True, but "
                    "its gradient is dense: the weight is also used outside the embedding (tied to an output "
                    "layer?). Make the embedding dense (sparse=False), or stop sharing its weight."
                )
        params = [param for _, param in self.plan.sparse]
        for param, averaged in zip(params, average_sparse([p.grad for p in params], params, self._link, "sparse")):
            param.grad = averaged

    def finish(self) -> None:
        """After Lightning's closure: make sure this step's buckets and mask were handed on (a rank
        that saw no gradient still issues every collective)."""
        if self.phase is CapturePhase.IDLE:
            self._begin(in_backward=False)
        self._finalize()

    def read_mask(self) -> None:
        """Wait for the used-mask and set `globally_used` (idempotent within a step)."""
        if self._mask_work is None:
            return
        self._mask_work.wait()
        self._mask_work = None
        flags = (self._mask > 0).tolist()
        offset = 0
        for b, n in enumerate(self._sizes):
            self.globally_used[b] = flags[offset : offset + n]
            offset += n

    def hand_back(self, buckets: Iterable[int]) -> None:
        """`.grad` of each parameter of `buckets` becomes a view of its averaged gradient in the bucket
        (None where no rank produced one this step, so the optimizer skips it), as DDP leaves them."""
        self.read_mask()  # which parameters got a gradient on some rank (waits once per step)
        for b in buckets:
            bucket = self.plan.buckets[b]
            for param, view, used in zip(bucket.params, bucket.views, self.globally_used[b]):
                param.grad = view if used else None

    def agree_on_idle(self, agree: bool) -> None:
        """Before a backward (all ranks together, with the same `agree`): which buckets no rank can fill, from
        one small all-reduce on the mask's link (a GAN's backward of one half leaves the other half's buckets
        idle); `agree=False`: none, without a collective."""
        self.idle = frozenset()
        if not agree:
            return
        busy = [any(p.requires_grad or p.grad is not None for p in bucket.params) for bucket in self.plan.buckets]
        flags = self._link.tensor(busy, torch.float32)
        self._link.all_reduce(flags, "idle-buckets").wait()
        self.idle = frozenset(b for b, count in enumerate(flags.tolist()) if count == 0)

    def reset(self) -> None:
        self.phase = CapturePhase.IDLE
        self.idle = frozenset()
