"""DeAR: reduce-scatter in backward (BackPipe), all-gather overlapped with the next forward (FeedPipe).

Update arrangement (option a of the two the paper allows): at the end of backward each rank holds
its shard of every bucket's averaged gradient, and the all-gathers of the *gradients* start right
away, one after another in the order the next forward needs them (`InOrder`: on a saturated link
the first one needed is not slowed down by the others). The user's own optimizer is run bucket by
bucket in the next forward, just before the first module that owns a parameter of the bucket
runs, with the hyper-parameters snapshotted at step time. This keeps any torch optimizer, its
state and its checkpoints exactly as under DDP (a plain `ddp` run can resume from them), at the
price of the full optimizer work on every rank -- the same work DDP does. Clipping takes the
global norm from the shards (one scalar all-reduce) and scales each bucket once it is gathered
(scaling and clamping commute with the all-gather).

Nobody sees the difference (`commsched.schedules.pending_tensors`): between backward and the step the parameters'
`.grad` is pending, and the first read or write of one waits for the all-gathers (already on
their way: no collective is issued out of order, whichever ranks look) and takes the step at
once; after the step, each parameter, its `.grad` and its optimizer state are pending until its
bucket is applied, and the first touch from anywhere (a callback, `training_step`, another
module) applies it. Code that touches neither keeps the overlap at no cost. The first step of a
fit is taken at once, so that the optimizer's state exists from then on as under DDP.

Each bucket's two halves go over one link: the primary, or the link `DeARSettings.bucket_links`
names (DeFT hands its iterations to DeAR over both of its links when that is faster); each link
then has its own chain of all-gathers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from commsched.comm.buckets import BucketPlan
from commsched.hooks import OwnHook
from commsched.comm.links import Links, Pending
from commsched.schedules.pending_tensors import Kind, PendingTensors
from commsched.reducers.striped import StripedShards, Together
from commsched.interleaved import MeasuredChoice
from commsched.schedules.dear_fallback import WFBP, describe_fallback, fallback_choice
from commsched.say import say, size_text
from commsched.schedules.base import Handover, Schedule, runs_compiled
from commsched.schedules.dear_clipping import optimizer_segments, squared_norm
from commsched.schedules.dear_update import Gathers, PendingUpdate, landed, start_gathers, taken_back
from commsched.schedules.partial_step import StepUndo, SubsetStepper, snapshot_hyperparams
from commsched.schedules.per_parameter import per_parameter_classes
from commsched.schedules.step_control import run_with_step_replaced
from commsched.sim import timelines
from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Buckets, Result
from commsched.sim.workload import Workload
from commsched.options import BUILTIN, DeAROptions, StrategyOptions, StreamOptions
from commsched.streams.control import StreamControl
from commsched.reducers.units import Striping, Unit, plan_units


@dataclass(frozen=True)
class DeARSettings:
    bucket_links: Optional[tuple[str, ...]] = None
    """Per bucket, the link of its reduce-scatter and all-gather (None: the primary for every bucket)."""
    streams: Optional[StreamControl] = None
    """Units on several streams of the primary (None: one stream; not with `bucket_links`)."""
    fallback: Optional[MeasuredChoice] = None
    """WFBP (arm 0) or DeAR (arm 1), measured on real steps (`DeAROptions.fallback`); kept across bucket rebuilds."""
    rollback: bool = True
    """Copies kept of what is applied before the step's last all-gathers land (`DeAROptions.rollback`)."""
    per_parameter: tuple[type, ...] = ()
    """Optimizer classes the user declared to step each parameter alone (`DeAROptions.per_parameter`)."""


class DeARSchedule(Schedule[DeARSettings]):
    name = "dear"
    options_class = DeAROptions
    planner = "dear-model"
    hands_over_to = ("wfbp",)  # `DeAROptions.fallback`
    description = "commsched DeAR: reduce-scatter in backward, all-gather overlapped with the next forward"
    step_collectives = ("reduce_scatter", "all_gather")
    steps_whole = False  # each bucket's update is applied when its all-gather lands, in the next forward
    grads_complete_after_closure = False
    mask_link = "control"  # the primary is busy with the reduce-scatters when the mask goes out
    stripes = BUILTIN["dear"].stripes  # the catalogue the options are checked against before torch is imported

    def __init__(self, plan: BucketPlan, links: Links, settings: Any = None) -> None:
        super().__init__(plan, links, settings)
        self.settings: DeARSettings = settings if isinstance(settings, DeARSettings) else DeARSettings()
        self.streams: StreamControl = self.settings.streams or StreamControl(1, StreamOptions())
        self.reducers: list[StripedShards] = self._build_reducers(self.streams.striping)
        self._scatters: list[Optional[Together]] = [None] * len(plan.buckets)
        self._gathers: Optional[Gathers] = None  # this step's all-gathers, started at the end of backward
        self._clip: Optional[Callable[[torch.Tensor], Any]] = None  # clipping, applied to each bucket once gathered
        self._pending: Optional[PendingUpdate] = None
        self._whole = False  # this step's gradients were made whole (someone read `.grad`)
        self._steps = 0
        self._stepper: Optional[SubsetStepper] = None
        self._norm_segments: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}
        self._owner_buckets: dict[int, tuple[int, ...]] = {}  # module id -> buckets of its parameters
        self._compiled = False
        self.pending = PendingTensors(self._bring_up_to_date)
        self._undo: Optional[StepUndo] = StepUndo() if self.settings.rollback else None
        self.rollback_peak_bytes = 0
        """The memory the copies hold (`DeAROptions.rollback`): kept from step to step, so the most any
        step's copies needed, and more where different steps copied different buckets."""
        self.applied: Counter[str] = Counter()
        """Buckets applied, by what brought them: "forward" (the module that needs them is about to run:
        the overlap DeAR is for), "touch", "after_forward", "flush", "unwatchable", "compiled" (before a
        torch.compile'd forward); "whole": steps whose gradients were made whole at once."""

    # ----------------------------------------------------------------- lifecycle
    @override
    def attach(self, module: nn.Module) -> None:
        super().attach(module)
        self._compiled = runs_compiled(module)
        if self._compiled:
            return  # updates are applied before the compiled region, not from hooks inside it
        where = {id(p): bucket.index for bucket in self.plan.buckets for p in bucket.params}
        for sub in module.modules():
            buckets = {where[id(p)] for p in sub.parameters(recurse=False) if id(p) in where}
            if buckets and sub is not module:
                self._owner_buckets[id(sub)] = tuple(sorted(buckets, reverse=True))
                self._handles.append(sub.register_forward_pre_hook(OwnHook(partial(self._before_module, id(sub)))))
            if self._undo is not None and any(name not in sub._non_persistent_buffers_set for name in sub._buffers):
                self._handles.append(sub.register_forward_pre_hook(OwnHook(self._before_buffers_change)))

    @override
    def after_failure(self) -> Optional[str]:
        """A step still partly on the network is taken back (the copies `DeAROptions.rollback` keeps),
        so that the weights are those of one step. Taken back on every rank, even where the rest of
        its all-gathers happen to have landed: whether one has landed yet when the failure is noticed
        differs from rank to rank, and the surviving ranks must keep the same model."""
        with self.pending.lock:
            pending, self._pending = self._pending, None  # None once every bucket of the step is applied
            if pending is None:
                return None
            self.pending.unmark_all()  # what is left cannot be applied: reading the tensors must not try
            return taken_back(pending)

    @override
    def detach(self) -> None:
        """After a flush (the engine's), or after a failure: nothing pending is applied here."""
        self.pending.unmark_all()
        super().detach()

    def _build_reducers(self, striping: Striping) -> list[StripedShards]:
        """Each bucket's units on their streams (one unit per bucket with one stream); DeFT's hand-over
        names a link per bucket instead."""
        if self.settings.bucket_links is not None:
            return [StripedShards(b, [Unit(b.index, 0, b.buffer.numel(), 0)], [self.links[name]])
                    for b, name in zip(self.plan.buckets, self.settings.bucket_links)]
        streams = self.links.streams("primary", striping.streams)
        return [StripedShards(b, units, streams) for b, units in zip(self.plan.buckets, plan_units(self.plan, striping))]

    @classmethod
    @override
    def settings_for(cls, options: StrategyOptions, trainer: Any, advance_schedulers: Callable[[], None]) -> DeARSettings:
        o = options.dear
        fallback = (fallback_choice(o, lambda: getattr(trainer.strategy, "profile", None))
                    if o.fallback == "when_faster" and options.streams == 1 and trainer.world_size > 1 else None)
        return DeARSettings(streams=StreamControl.of(options.streams, options.stream_options, trainer, two_level=False),
                            fallback=fallback, rollback=o.rollback, per_parameter=tuple(per_parameter_classes(o.per_parameter)))

    @override
    def at_boundary(self) -> Optional[Handover]:
        """Between trials of the stream search: the pending update is applied (its all-gathers are in
        flight on the old streams) before the buckets' units move. Once the buckets are decided, DeAR
        and WFBP take turns until the faster is known (`DeAROptions.fallback`): WFBP's turns are
        handed over to it (the engine applies DeAR's pending update first)."""
        self._follow_streams()
        fallback = self.settings.fallback
        if fallback is None or self.settling:
            return None
        verdict = fallback.verdict
        fallback.at_boundary(self.links.control)
        if fallback.verdict is not None and fallback.verdict is not verdict:
            say(f"commsched dear: {self._describe_fallback()}")
        if fallback.arm != WFBP:
            return None
        self.flush()  # this step's update lands before WFBP takes the iterations (nothing, once it has them)
        return Handover("wfbp")

    def _describe_fallback(self) -> str:
        return describe_fallback(self.settings.fallback) if self.settings.fallback is not None else ""

    @override
    def choices(self) -> dict[str, MeasuredChoice]:
        return {"fallback": self.settings.fallback} if self.settings.fallback is not None else {}

    @property
    @override
    def settled(self) -> bool:
        return super().settled and (self.settings.fallback is None or not self.settings.fallback.deciding)

    @override
    def summary(self) -> list[str]:
        peak = max(self.rollback_peak_bytes, self._undo.reserved_bytes if self._undo is not None else 0)  # buffers too
        rollback = [f"copies kept to take a step back on failure: at most {size_text(peak)} (DeAROptions.rollback)"] if peak else []
        stepping = [self._stepper.mode.describe(self._stepper.optimizer)] if self._stepper is not None else []
        return ([self._describe_fallback()] if self.settings.fallback is not None else []) + stepping + rollback + super().summary()

    @override
    def _restripe(self, striping: Striping) -> None:
        self.flush()
        self.reducers = self._build_reducers(striping)
        self._norm_segments.clear()

    # ------------------------------------------------------------------ backward
    @override
    def on_bucket_ready(self, b: int) -> None:
        self._scatters[b] = self.reducers[b].scatter(f"bucket{b}")

    @override
    def on_backward_end(self) -> None:
        """Every reduce-scatter is requested: the all-gathers are requested now, each to go once its own
        bucket's reduce-scatter (and the one before it in the chain) is done, at the same point on every
        rank and before any user hook runs; backward ends without waiting for the network, and whatever
        reads `.grad` later only waits for collectives already on their way."""
        self._gathers = start_gathers(self.reducers, self.links, self._gather)
        self._whole, self._clip = False, None
        for b, bucket in enumerate(self.plan.buckets):
            self.pending.mark(b, bucket.params, Kind.GRADIENT)

    def _bring_up_to_date(self, buckets: set[int], kind: Kind) -> None:
        """`commsched.schedules.pending_tensors`'s callback: someone touched a pending tensor."""
        if kind is Kind.GRADIENT:
            self._make_whole()
        else:
            for b in sorted(buckets, reverse=True):
                self._apply(b, "touch")

    def _make_whole(self) -> None:
        """Every gradient whole and in `.grad`, as DDP leaves them after backward."""
        self.pending.unmark_all()
        assert self._gathers is not None
        for b in reversed(range(len(self.plan.buckets))):
            self._gathers.wait(b)
            if self._clip is not None:
                self._clip(self.plan.buckets[b].buffer)
        self.hand_back_gradients(range(len(self.plan.buckets)))
        self._whole, self._clip = True, None
        self.applied["whole"] += 1

    def _gather(self, b: int, u: int, previous: Optional[Pending]) -> Pending:
        scattered = self._scatters[b]
        assert scattered is not None, "every bucket is scattered before the all-gathers are requested"
        return self.reducers[b].gather_unit(u, [p for p in (previous, scattered.pending[u]) if p is not None])

    def _scattered(self) -> None:
        """Wait for this step's reduce-scatters (clipping reads the shards)."""
        for work in self._scatters:
            if work is not None:
                work.wait()

    # ------------------------------------------------------------------ clipping
    @override
    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        """The global norm from this rank's slice of every bucket (its shard, or its part of the whole
        gradient once someone read `.grad`) and one scalar all-reduce on the control link (the primary
        is busy with the all-gathers). Scaling commutes with the all-gather: whole gradients are
        scaled now, gathered ones when their bucket is applied."""
        self._scattered()
        key = SubsetStepper.key(optimizer)
        if key not in self._norm_segments:
            self._norm_segments[key] = optimizer_segments(self.plan, self.reducers, optimizer)
        squares = squared_norm(self.plan, self.reducers, self._norm_segments[key], self._whole)
        control = self.links.control
        squares = squares.to(control.device)
        control.all_reduce(squares, "clip-norm").wait()
        coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        self._clip_all(lambda t: t.mul_(coefficient.to(t.device, t.dtype)))

    @override
    def clip_grad_value(self, optimizer: Optimizer, clip_value: float) -> None:
        self._clip_all(lambda t: t.clamp_(min=-clip_value, max=clip_value))

    def _clip_all(self, clip: Callable[[torch.Tensor], Any]) -> None:
        if self._whole:
            for bucket in self.plan.buckets:
                clip(bucket.buffer)
        else:
            self._clip = clip

    # ------------------------------------------------------------------- update
    @override
    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        """Let Lightning run closure, hooks and clipping; the update itself is the schedule's."""
        return run_with_step_replaced(optimizer, run_step, lambda real_step, kwargs: self.step(optimizer, partial(real_step, **kwargs)))

    def step(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        """After the closure: take the step at once (gradients already whole, or the fit's first step)
        or defer it to the next forward (the parameters stay marked, now for their update)."""
        if self._steps == 0 and not self._whole:
            self._make_whole()
        self._steps += 1
        if self._whole:
            real_step()
        else:
            self._defer(optimizer, real_step)
        # The update is real (taken or on its way): keep torch's scheduler from warning that it stepped first.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _defer(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        assert self._gathers is not None
        if self._stepper is None or self._stepper.key_at_build != SubsetStepper.key(optimizer):
            self._stepper = SubsetStepper(optimizer, [b.params for b in self.plan.buckets], self.settings.per_parameter)
        self._pending = PendingUpdate(self._stepper, real_step, snapshot_hyperparams(optimizer), self._gathers, self._clip,
                                       [True] * len(self.plan.buckets), self._undo.begin() if self._undo is not None else None, set())
        state = optimizer.state
        unwatched = []
        for b, bucket in enumerate(self.plan.buckets):
            tensors = [*bucket.params, *(v for p in bucket.params if p in state for v in state[p].values()
                                         if isinstance(v, torch.Tensor))]
            if not self.pending.mark(b, tensors, Kind.UPDATE):
                unwatched.append(b)
        for b in unwatched:
            self._apply(b, "unwatchable")

    def _apply(self, b: int, why: str) -> None:
        """Apply bucket `b`'s update, waiting for its all-gather; buckets whose all-gathers have
        landed already are applied in the same optimizer call. An optimizer that is not stepped
        bucket by bucket (`SubsetStepper.mode`) waits for every all-gather and steps whole."""
        with self.pending.lock:
            pending = self._pending
            if pending is None or not pending.waiting[b]:
                return
            split = pending.stepper.mode.split
            ready = [b] + [c for c, waiting in enumerate(pending.waiting)
                           if waiting and c != b and (not split or landed(pending.gathers, c))]
            for c in ready if not split else [b]:
                pending.gathers.wait(c)  # re-raises a failure before anything changes
            for c in ready:
                self.pending.unmark(c)  # before anything below reads its tensors
                pending.waiting[c] = False
                if pending.clip is not None:
                    pending.clip(self.plan.buckets[c].buffer)
            if pending.undo is not None and any(pending.waiting):  # others' all-gathers may still fail
                for c in ready:
                    pending.undo.keep(self.plan.buckets[c].params, pending.stepper.optimizer.state)
                pending.kept.update(ready)
                self.rollback_peak_bytes = max(self.rollback_peak_bytes, pending.undo.reserved_bytes)
            self.hand_back_gradients(ready)
            self.applied[why] += len(ready)
            pending.stepper.step_buckets(ready, pending.hyper, pending.step)
            if not any(pending.waiting):
                self._pending = None

    def _before_buffers_change(self, module: nn.Module, args: Any) -> None:
        """A module in training with saved buffers (BatchNorm's statistics) is about to run while a step is
        partly applied: copies of them, so that a step taken back takes back what this forward changed."""
        pending = self._pending
        if pending is not None and pending.undo is not None and module.training:
            pending.undo.keep_buffers([b for name, b in module._buffers.items()
                                       if b is not None and name not in module._non_persistent_buffers_set])

    def _before_module(self, module_id: int, module: nn.Module, args: Any) -> None:
        if self._pending is not None:
            for b in self._owner_buckets[module_id]:
                self._apply(b, "forward")

    @override
    def before_forward(self) -> None:
        """A torch.compile'd module: every update lands before the compiled forward starts. A hook
        calling back into Python inside the compiled region would break its graph at every bucket (and
        a pending parameter's class would change what the compiled code guards on), costing more than
        the all-gathers' overlap with the forward earns."""
        if self._compiled:
            self.flush("compiled")

    @override
    def after_forward(self) -> None:
        """Buckets whose modules did not run in this forward: applied before backward refills the buckets."""
        self.flush("after_forward")

    @override
    def flush(self, why: str = "flush") -> None:
        for b in reversed(range(len(self.plan.buckets))):
            self._apply(b, why)

    @staticmethod
    @override
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """[DeAR] Eq. 8."""
        return max(t_ff, totals["all_gather"]) + max(t_bp, totals["reduce_scatter"])

    @classmethod
    @override
    def simulate(cls, workload: Workload, network: CostModel, workers: int, buckets: Buckets) -> Result:
        return timelines.dear(workload, network, workers, buckets)
