"""DeAR: reduce-scatter in backward (BackPipe), all-gather overlapped with the next forward (FeedPipe).

Update arrangement (option a of the two the paper allows): after backward each rank holds its shard of every
bucket's averaged gradient. Clipping is done on the shards (one scalar all-reduce gives the global
norm). The all-gathers of the *gradients* start right away, one after another in the order the next
forward needs them (`InOrder`: on a saturated link the first one needed is not slowed down by the
others), and the user's own optimizer is run
bucket by bucket in the next forward, just before the first module that owns a parameter of the
bucket runs, with the hyper-parameters snapshotted at step time. This keeps any torch optimizer,
its state and its checkpoints exactly as under DDP (a plain `ddp` run can resume from them), at
the price of the full optimizer work on every rank -- the same work DDP does.

Each bucket's two halves go over one link: the primary, or the link `DeARSettings.bucket_links`
names (DeFT hands its iterations to DeAR over both of its links when that is faster); each link
then has its own chain of all-gathers.

When user code reads gradients after backward (`Observed.gradients`), the all-gathers run at the
end of backward instead and the step is taken at once: the forward overlap is given up so that
`on_after_backward` and `on_before_optimizer_step` see whole, averaged gradients as under DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from commsched.buckets import BucketPlan
from commsched.links import InOrder, Links, Pending
from commsched.reducers import ShardedReduce
from commsched.schedules.base import Observed, Schedule
from commsched.schedules.partial_step import HyperParams, SubsetStepper, snapshot_hyperparams
from commsched.schedules.step_control import run_with_step_replaced


@dataclass(frozen=True)
class DeARSettings:
    bucket_links: Optional[tuple[str, ...]] = None
    """Per bucket, the link of its reduce-scatter and all-gather (None: the primary for every bucket)."""


class _PendingUpdate:
    """The update of one optimizer step, waiting to be applied bucket by bucket."""

    def __init__(self, stepper: SubsetStepper, step: Callable[[], Any], hyper: HyperParams, gathers: dict[str, InOrder],
                 position: dict[int, tuple[str, int]]) -> None:
        self.stepper = stepper
        self.step = step
        self.hyper = hyper
        self.gathers = gathers
        self.position = position  # bucket -> its link's chain of all-gathers and its place in it
        self.waiting = [True] * len(position)  # False once the bucket is applied
        self.left = len(position)

    def wait(self, b: int) -> None:
        chain, i = self.position[b]
        self.gathers[chain].wait(i)

    def done(self, b: int) -> bool:
        chain, i = self.position[b]
        return self.gathers[chain].done(i)


class DeARSchedule(Schedule):
    name = "dear"
    description = "commsched DeAR: reduce-scatter in backward, all-gather overlapped with the next forward"
    step_collectives = ("reduce_scatter", "all_gather")
    grads_complete_after_closure = False
    applies_late = True

    def __init__(self, plan: BucketPlan, links: Links, observed: Observed = Observed(), settings: Any = None) -> None:
        super().__init__(plan, links, observed, settings)
        names = getattr(settings, "bucket_links", None) or ("primary",) * len(plan.buckets)
        self._bucket_links = [links[name] for name in names]
        self._reducers = [ShardedReduce(b.buffer, link) for b, link in zip(plan.buckets, self._bucket_links)]
        self._scatters: list[Optional[Pending]] = [None] * len(plan.buckets)
        self._pending: Optional[_PendingUpdate] = None
        self._stepper: Optional[SubsetStepper] = None
        self._norm_segments: dict[tuple[int, ...], list[list[tuple[int, int]]]] = {}
        self._owner_buckets: dict[int, tuple[int, ...]] = {}  # module id -> buckets of its parameters
        self._early: list[bool] = [False] * len(plan.buckets)
        self._learning = True  # first training step: learn which parameters are read outside their module
        self._recording = False
        self._modules_run: set[int] = set()
        self._owners_of: list[list[tuple[int, ...]]] = []

    # ----------------------------------------------------------------- lifecycle
    def attach(self, module: nn.Module) -> None:
        super().attach(module)
        where = {id(p): (bucket.index, slot) for bucket in self.plan.buckets for slot, p in enumerate(bucket.params)}
        owners: list[list[list[int]]] = [[[] for _ in b.params] for b in self.plan.buckets]
        for p in module.parameters(recurse=False):  # the LightningModule's own: read in training_step
            if id(p) in where:
                self._early[where[id(p)][0]] = True
        for sub in module.modules():
            if sub is module:
                continue
            buckets = set()
            for p in sub.parameters(recurse=False):
                if id(p) in where:
                    b, slot = where[id(p)]
                    buckets.add(b)
                    owners[b][slot].append(id(sub))
            if buckets:
                self._owner_buckets[id(sub)] = tuple(sorted(buckets, reverse=True))
                self._handles.append(sub.register_forward_pre_hook(partial(self._before_module, id(sub))))
        self._owners_of = [[tuple(o) for o in per_bucket] for per_bucket in owners]

    # ------------------------------------------------------------------ backward
    def _bucket_ready(self, b: int) -> None:
        self._scatters[b] = self._reducers[b].scatter(f"bucket{b}")

    def _backward_end(self) -> None:
        for b, work in enumerate(self._scatters):
            assert work is not None
            work.wait()
            self._scatters[b] = None
        self.capture.read_mask()
        if self._learning:
            self._learn_early_buckets()
        if self.observed.gradients:  # whole gradients before on_after_backward, as DDP
            for work in [reducer.gather(f"bucket{b}") for b, reducer in enumerate(self._reducers)]:
                work.wait()
            self._hand_back_gradients(range(len(self.plan.buckets)))

    def _learn_early_buckets(self) -> None:
        """A parameter that got a gradient although none of its modules ran is read directly (e.g. a
        parameter of the LightningModule itself); its bucket is applied before `training_step`."""
        for b, bucket in enumerate(self.plan.buckets):
            for slot in range(len(bucket.params)):
                ran = any(owner in self._modules_run for owner in self._owners_of[b][slot])
                if self.capture.filled(b, slot) and not ran:
                    self._early[b] = True
        self._learning = False
        self._modules_run.clear()

    def _hand_back_gradients(self, buckets: Any) -> None:
        """`.grad` becomes a view of the whole averaged gradient (None where no rank produced one), as under DDP."""
        for b in buckets:
            bucket = self.plan.buckets[b]
            for param, view, used in zip(bucket.params, bucket.views, self.capture.globally_used[b]):
                param.grad = view if used else None

    # ------------------------------------------------------------------ clipping
    def _segments(self, optimizer: Optimizer) -> list[list[tuple[int, int]]]:
        """Per bucket, the (start, length) ranges of this rank's shard that belong to `optimizer`'s parameters."""
        key = SubsetStepper.key(optimizer)
        if key not in self._norm_segments:
            members = {id(p) for g in optimizer.param_groups for p in g["params"]}
            rank = self.link.rank
            per_bucket = []
            for bucket in self.plan.buckets:
                lo, hi = rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel
                ranges = []
                for p, start in zip(bucket.params, bucket.offsets()):
                    a, z = max(start, lo), min(start + p.numel(), hi)
                    if id(p) in members and a < z:
                        ranges.append((a - lo, z - a))
                per_bucket.append(ranges)
            self._norm_segments[key] = per_bucket
        return self._norm_segments[key]

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        if self.observed.gradients:
            return super().clip_grad_norm(optimizer, max_norm)
        squares = torch.zeros(1, dtype=torch.float32, device=self.link.device)
        for reducer, ranges in zip(self._reducers, self._segments(optimizer)):
            for start, length in ranges:
                squares += torch.linalg.vector_norm(reducer.shard.narrow(0, start, length), dtype=torch.float32).square()
        self.link.all_reduce(squares, "clip-norm").wait()
        coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for reducer in self._reducers:
            reducer.shard.mul_(coefficient.to(reducer.shard.dtype))

    def clip_grad_value(self, optimizer: Optimizer, clip_value: float) -> None:
        if self.observed.gradients:
            return super().clip_grad_value(optimizer, clip_value)
        for reducer in self._reducers:
            reducer.shard.clamp_(min=-clip_value, max=clip_value)

    # ------------------------------------------------------------------- update
    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        """Let Lightning run closure, hooks and clipping, but defer the actual update to the next forward."""
        if self.observed.gradients:
            return run_step()
        return run_with_step_replaced(optimizer, run_step, lambda real_step, kwargs: self.defer_step(optimizer, real_step))

    def defer_step(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        """Take the step `real_step` would take bucket by bucket in the next forward (the closure has run)."""
        self.flush()
        if self._stepper is None or self._stepper.key_at_build != SubsetStepper.key(optimizer):
            self._stepper = SubsetStepper(optimizer, [b.params for b in self.plan.buckets])
        chains: dict[str, list[int]] = {}
        for b in reversed(range(len(self.plan.buckets))):  # forward needs the last bucket first
            chains.setdefault(self._bucket_links[b].name, []).append(b)
        gathers = {name: self.links[name].in_order([partial(self._reducers[b].gather, f"bucket{b}") for b in order])
                   for name, order in chains.items()}
        position = {b: (name, i) for name, order in chains.items() for i, b in enumerate(order)}
        self._pending = _PendingUpdate(self._stepper, real_step, snapshot_hyperparams(optimizer), gathers, position)
        # The update is real, only later: keep torch's scheduler from warning that it stepped first.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _apply(self, b: int) -> None:
        """Apply bucket `b`'s update, waiting for its all-gather; buckets whose all-gathers have
        landed already are applied in the same optimizer call."""
        pending = self._pending
        if pending is None or not pending.waiting[b]:
            return
        pending.wait(b)
        ready = [b] + [c for c, waiting in enumerate(pending.waiting) if waiting and c != b and pending.done(c)]
        for c in ready:
            pending.wait(c)  # completed: re-raises a failure, runs nothing
            pending.waiting[c] = False
        self._hand_back_gradients(ready)
        pending.stepper.step_buckets(ready, pending.hyper, pending.step)
        pending.left -= len(ready)
        if pending.left == 0:
            self._pending = None

    def _before_module(self, module_id: int, module: nn.Module, args: Any) -> None:
        if self._pending is not None:
            for b in self._owner_buckets[module_id]:
                self._apply(b)
        elif self._recording:
            self._modules_run.add(module_id)

    def before_forward(self) -> None:
        self.capture.stale[:] = [False] * len(self.capture.stale)
        self._recording = self._learning
        if self._pending is not None:
            for b in reversed(range(len(self.plan.buckets))):
                if self._early[b]:
                    self._apply(b)

    def after_forward(self) -> None:
        """Buckets whose modules did not run this forward are applied now and watched: a gradient
        for one of their parameters would mean it was read while stale."""
        self._recording = False
        if self._pending is not None:
            for b in reversed(range(len(self.plan.buckets))):
                if self._pending is not None and self._pending.waiting[b]:
                    self.capture.stale[b] = True
                    self._apply(b)

    def flush(self) -> None:
        for b in reversed(range(len(self.plan.buckets))):
            self._apply(b)

    @staticmethod
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """[DeAR] Eq. 8."""
        return max(t_ff, totals["all_gather"]) + max(t_bp, totals["reduce_scatter"])
