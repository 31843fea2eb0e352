"""What every schedule shares: gradient hooks, bucket filling, in-order launching, the used-mask.

The invariant that keeps ranks in lock-step: every optimizer step issues each bucket's collective
exactly once, in bucket order, followed by one small all-reduce of the "gradient produced" mask.
Buckets launch during backward as soon as they and all earlier buckets are complete; whatever is
left (parameters that got no gradient on this rank) is launched at the end of backward, with
zeros in place of the missing gradients. The mask tells every rank which parameters got a
gradient on *some* rank, so a parameter unused everywhere keeps `.grad = None` and the optimizer
skips it, exactly as DDP with `find_unused_parameters=True` does.
"""

from __future__ import annotations

import enum
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from commsched.buckets import BucketPlan
from commsched.errors import ScheduleError
from commsched.links import Link, Pending


class _Phase(enum.Enum):
    IDLE = "idle"  # no gradient of this step seen yet
    COLLECTING = "collecting"  # backward running, buckets filling and launching
    LAUNCHED = "launched"  # every bucket and the mask are in flight


class Schedule:
    """Base runtime. Subclasses implement `_launch(b)` and `_complete_reduction()`."""

    name = "base"
    grads_complete_after_closure = True  # False: `.grad` is not whole when Lightning's hooks run

    def __init__(self, plan: BucketPlan, link: Link) -> None:
        self.plan = plan
        self.link = link
        self.sync_enabled = True  # False inside Lightning's no-sync accumulation micro-batches
        self._scale = 1.0 / plan.world_size  # DDP divides while copying into the bucket
        self._sizes = [len(b.params) for b in plan.buckets]
        self._remaining = list(self._sizes)
        self._filled = [[False] * n for n in self._sizes]
        self._next = 0
        self._phase = _Phase.IDLE
        self._mask_work: Optional[Pending] = None
        self._mask = torch.zeros(plan.num_params)
        self.globally_used: list[list[bool]] = [[True] * n for n in self._sizes]
        self._stale = [False] * len(plan.buckets)  # set by schedules that may apply updates late
        self._handles: list[RemovableHandle] = []

    # ----------------------------------------------------------------- lifecycle
    def attach(self, module: nn.Module) -> None:
        for bucket in self.plan.buckets:
            for slot, param in enumerate(bucket.params):
                hook = partial(self._grad_ready, bucket.index, slot)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ backward
    def _grad_ready(self, b: int, slot: int, param: nn.Parameter) -> None:
        if self._stale[b]:
            raise ScheduleError(
                f"commsched {self.name}: parameter '{self.plan.buckets[b].names[slot]}' was read in this forward "
                "before its pending update was applied: it is used outside the forward of the module that owns "
                "it, and was not used that way in the first training step. Use it through its module, or use "
                "strategy='wfbp'."
            )
        if not self.sync_enabled:
            return
        if self._phase is not _Phase.COLLECTING:
            self._begin_step(in_backward=True)
        if self._filled[b][slot]:
            return
        self._fill(b, slot, param)
        self._remaining[b] -= 1
        if b == self._next and self._remaining[b] == 0:
            self._launch_in_order()

    def _fill(self, b: int, slot: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad.is_sparse:
            raise ScheduleError(
                f"commsched: parameter '{self.plan.buckets[b].names[slot]}' has a sparse gradient; "
                "sparse gradients are not supported (use dense embeddings)."
            )
        torch.mul(grad, self._scale, out=self.plan.buckets[b].views[slot])
        self._filled[b][slot] = True
        param.grad = None  # the gradient lives in the bucket now; the schedule hands it back later

    def _begin_step(self, in_backward: bool) -> None:
        if self._phase is _Phase.LAUNCHED:
            raise ScheduleError(
                f"commsched {self.name}: a second backward ran in one optimizer step after the gradients were "
                "already sent. Call backward once per optimizer step (use gradient accumulation instead)."
            )
        self._phase = _Phase.COLLECTING
        self._remaining[:] = self._sizes
        for filled in self._filled:
            filled[:] = [False] * len(filled)
        self._next = 0
        if in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _launch_in_order(self) -> None:
        while self._next < len(self._sizes) and self._remaining[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _finalize(self) -> None:
        """End of backward: launch what is left, treating gradients that never came as zeros."""
        if self._phase is not _Phase.COLLECTING:
            return
        for b in range(self._next, len(self._sizes)):
            if not self._remaining[b]:
                continue
            bucket = self.plan.buckets[b]
            for slot, param in enumerate(bucket.params):
                if self._filled[b][slot]:
                    continue
                if param.grad is not None:  # accumulated on earlier micro-batches, unused in the last one
                    self._fill(b, slot, param)
                else:
                    bucket.views[slot].zero_()
            self._remaining[b] = 0
        self._launch_in_order()
        used = [flag for filled in self._filled for flag in filled]
        self._mask.copy_(torch.tensor(used, dtype=self._mask.dtype))
        self._mask_work = self.link.all_reduce(self._mask, "used-mask")
        self._phase = _Phase.LAUNCHED

    def finish_backward(self) -> None:
        """After Lightning's closure: make sure everything launched, then wait for the reduction."""
        if self._phase is _Phase.IDLE:  # no gradient reached this rank: still issue every collective
            self._begin_step(in_backward=False)
        self._finalize()
        assert self._mask_work is not None
        self._mask_work.wait()
        flags = (self._mask > 0).tolist()
        offset = 0
        for b, n in enumerate(self._sizes):
            self.globally_used[b] = flags[offset : offset + n]
            offset += n
        self._complete_reduction()
        self._phase = _Phase.IDLE

    # ------------------------------------------------------------ subclass API
    def _launch(self, b: int) -> None:
        raise NotImplementedError

    def _complete_reduction(self) -> None:
        raise NotImplementedError

    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        """Run Lightning's precision-plugin step (closure, hooks, clipping, `optimizer.step`)."""
        return run_step()

    def before_forward(self) -> None:
        """Start of a training step, before the user's `training_step` runs."""

    def after_forward(self) -> None:
        """The user's `training_step` returned; backward has not started."""

    def flush(self) -> None:
        """Bring every parameter up to date (evaluation, checkpoint, end of training)."""

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(_params_of(optimizer), max_norm)

    def clip_grad_value(self, optimizer: Optimizer, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(_params_of(optimizer), clip_value)


def _params_of(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]
