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

Nobody sees the difference: between backward and the step the parameters' `.grad` is pending, and
the first read or write of one waits for the all-gathers (already on their way: no collective is
issued out of order, whichever ranks look) and takes the step at once; after the step, each
parameter, its `.grad` and its optimizer state are pending until its bucket is applied, and the
first touch from anywhere (a callback, `training_step`, another module) applies it. Code that
touches neither keeps the overlap at no cost. That whole path, from the end of backward to the
last bucket applied (and taken back after a failure), is `commsched.schedules.deferred_step`'s;
this module issues the communication and says when a module is about to run.

Each bucket's two halves go over one link: the primary, or the link `DeARSettings.bucket_links`
names (DeFT hands its iterations to DeAR over both of its links when that is faster); each link
then has its own chain of all-gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from commsched.comm.buckets import BucketPlan
from commsched.comm.link_groups import Links
from commsched.comm.links import InOrder, Pending
from commsched.hooks import OwnHook
from commsched.interleaved import MeasuredChoice
from commsched.loss_scale import non_finite
from commsched.options import BUILTIN, DeAROptions, StrategyOptions, StreamOptions
from commsched.reducers.dense import StripedShards, Together
from commsched.reducers.units import Striping, Unit, plan_units
from commsched.say import say
from commsched.schedules.base import Handover, Schedule, runs_compiled
from commsched.schedules.dear_fallback import WFBP, describe_fallback, fallback_choice
from commsched.schedules.deferred_step import DeferredStep, SubsetStepper
from commsched.schedules.optimizer_step import per_parameter_classes
from commsched.sim import timelines
from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Buckets, Result
from commsched.sim.workload import Workload
from commsched.streams.control import StreamControl


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
    mask_link = "control"  # the primary is busy with the reduce-scatters when the mask goes out
    stripes = BUILTIN["dear"].stripes  # the catalogue the options are checked against before torch is imported

    def __init__(self, plan: BucketPlan, links: Links, settings: Any = None) -> None:
        super().__init__(plan, links, settings)
        self.settings: DeARSettings = settings if isinstance(settings, DeARSettings) else DeARSettings()
        self.streams: StreamControl = self.settings.streams or StreamControl(1, StreamOptions())
        self.reducers: list[StripedShards] = self._build_reducers(self.streams.striping)
        self._scatters: list[Optional[Together]] = [None] * len(plan.buckets)
        self._norm_segments: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}
        self._owner_buckets: dict[int, tuple[int, ...]] = {}  # module id -> buckets of its parameters
        self._compiled = False
        self._unscale: Optional[torch.Tensor] = None  # fp16's 1/scale, while the shards are still scaled
        self.deferred = DeferredStep(plan, self.capture.hand_back, self.settings.rollback, self.settings.per_parameter)
        """The step from the end of backward to its last bucket applied in the next forward."""

    # ----------------------------------------------------------------- lifecycle
    @override
    def attach(self, module: nn.Module) -> None:
        super().attach(module)
        self._compiled = runs_compiled(module) or self.compiled_outside
        if self._compiled:
            return  # updates are applied before the compiled region, not from hooks inside it
        where = {id(p): bucket.index for bucket in self.plan.buckets for p in bucket.params}
        for sub in module.modules():
            buckets = {where[id(p)] for p in sub.parameters(recurse=False) if id(p) in where}
            if buckets and sub is not module:
                self._owner_buckets[id(sub)] = tuple(sorted(buckets, reverse=True))
                self._handles.append(sub.register_forward_pre_hook(OwnHook(partial(self._before_module, id(sub)))))
            if self.settings.rollback and any(name not in sub._non_persistent_buffers_set for name in sub._buffers):
                self._handles.append(
                    sub.register_forward_pre_hook(OwnHook(lambda module, args: self.deferred.keep_buffers(module)))
                )

    @override
    def after_failure(self) -> Optional[str]:
        return self.deferred.take_back()

    @override
    def detach(self) -> None:
        """After a flush (the engine's), or after a failure: nothing pending is applied here."""
        self.deferred.forget()
        super().detach()

    def _build_reducers(self, striping: Striping) -> list[StripedShards]:
        """Each bucket's units on their streams (one unit per bucket with one stream); DeFT's hand-over
        names a link per bucket instead."""
        if self.settings.bucket_links is not None:
            assert len(self.settings.bucket_links) == len(self.plan.buckets), "a link for every bucket of this plan"
            return [
                StripedShards(b, [Unit(b.index, 0, b.buffer.numel(), 0)], [self.links[name]])
                for b, name in zip(self.plan.buckets, self.settings.bucket_links)
            ]
        streams = self.links.streams("primary", striping.streams)
        return [
            StripedShards(b, units, streams) for b, units in zip(self.plan.buckets, plan_units(self.plan, striping))
        ]

    @classmethod
    @override
    def settings_for(
        cls, options: StrategyOptions, trainer: Any, advance_schedulers: Callable[[], None]
    ) -> DeARSettings:
        o = options.dear
        fallback = (
            fallback_choice(o, lambda: getattr(trainer.strategy, "profile", None))
            if o.fallback == "when_faster" and options.streams.count == 1 and trainer.world_size > 1
            else None
        )
        return DeARSettings(
            streams=StreamControl.of(options.streams, trainer, two_level=False),
            fallback=fallback,
            rollback=o.rollback,
            per_parameter=tuple(per_parameter_classes(o.per_parameter)),
        )

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
        return (
            ([self._describe_fallback()] if self.settings.fallback is not None else [])
            + self.deferred.summary()
            + super().summary()
        )

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
        self.deferred.gradients_on_their_way(start_gathers(self.reducers, self.links, self._gather))
        self._unscale = None

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
    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> torch.Tensor:
        """The global norm from this rank's slice of every bucket (its shard, or its part of the whole
        gradient once someone read `.grad`) and one scalar all-reduce on the control link (the primary
        is busy with the all-gathers). Scaling commutes with the all-gather: whole gradients are
        scaled now, gathered ones when their bucket is applied."""
        self._scattered()
        key = SubsetStepper.key(optimizer)
        if key not in self._norm_segments:
            self._norm_segments[key] = optimizer_segments(self.plan, self.reducers, optimizer)
        unscale = self._unscale if not self.deferred.whole else None  # gathered buckets are unscaled as they land
        squares = squared_norm(self.plan, self.reducers, self._norm_segments[key], self.deferred.whole, unscale)
        control = self.links.control
        squares = squares.to(control.device)
        control.all_reduce(squares, "clip-norm").wait()
        norm = squares.sqrt().reshape(())  # a scalar, as torch.nn.utils.clip_grad_norm_ returns it
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        self.deferred.transform_all(lambda t: t.mul_(coefficient.to(t.device, t.dtype)))
        return norm

    @override
    def clip_grad_value(self, optimizer: Optimizer, clip_value: float) -> None:
        self.deferred.transform_all(lambda t: t.clamp_(min=-clip_value, max=clip_value))

    # ------------------------------------------------------------ fp16's scaler
    @override
    def unscale_gradients(self, optimizer: Optimizer, inv_scale: torch.Tensor) -> Optional[torch.Tensor]:
        """The shards are checked for inf and NaN (one scalar all-reduce makes it every rank's finding) and
        each bucket is unscaled once gathered, before clipping, as DDP's whole gradients are: the
        all-gathers carry the scaled values, so a low-precision wire keeps the scale's headroom. A rank
        whose gradients someone made whole checks its slices of them instead and unscales them at once:
        every rank takes part in the all-reduce, whatever its callbacks read."""
        self._scattered()
        key = SubsetStepper.key(optimizer)
        if key not in self._norm_segments:
            self._norm_segments[key] = optimizer_segments(self.plan, self.reducers, optimizer)
        whole = self.deferred.whole  # someone read `.grad` on this rank: its slices of the whole buckets
        pieces = []
        for bucket, reducer, ranges in zip(self.plan.buckets, self.reducers, self._norm_segments[key]):
            held = reducer.pieces()
            for i, start, length in ranges:
                lo, shard = held[i]
                piece = bucket.buffer.narrow(0, lo, shard.numel()) if whole else shard
                pieces.append(piece.narrow(0, start, length))
        found = self.agreed(non_finite(pieces))  # on every rank, whether or not its gradients were made whole
        self._unscale = None if whole else inv_scale
        self.deferred.transform_all(lambda t: t.mul_(inv_scale.to(t.device)))  # at once where whole
        return found

    # ------------------------------------------------------------------- update
    @override
    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        return self.deferred.replace_step(optimizer, run_step)

    def _before_module(self, module_id: int, module: nn.Module, args: Any) -> None:
        if self.deferred.in_flight:
            for b in self._owner_buckets[module_id]:
                self.deferred.apply(b, "forward")

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
        self.deferred.flush(why)

    @staticmethod
    @override
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """[DeAR] Eq. 8."""
        return max(t_ff, totals["all_gather"]) + max(t_bp, totals["reduce_scatter"])

    @classmethod
    @override
    def simulate(cls, workload: Workload, network: CostModel, workers: int, buckets: Buckets) -> Result:
        return timelines.dear(workload, network, workers, buckets)


# ------------------------------------------------- the all-gathers of one step
class Gathers:
    """One step's all-gathers: a chain per link (stream), each in the order the next forward needs
    its buckets; a bucket's units may lie on several chains."""

    def __init__(self, chains: dict[str, InOrder], position: dict[int, list[tuple[str, int]]]) -> None:
        self._chains = chains
        self._position = position  # bucket -> its units' chains and their places in them

    def wait(self, b: int) -> None:
        for chain, i in self._position[b]:
            self._chains[chain].wait(i)

    def done(self, b: int) -> bool:
        return all(self._chains[chain].done(i) for chain, i in self._position[b])


def start_gathers(
    reducers: Sequence[StripedShards], links: Links, gather: Callable[[int, int, Optional[Pending]], Pending]
) -> Gathers:
    """Request every bucket's all-gathers: one chain per link (stream), in the order the next forward
    needs the buckets (the last bucket first); `gather(b, u, previous)` starts unit u of bucket b
    once `previous` (the chain's last) is done."""
    chains: dict[str, list[tuple[int, int]]] = {}
    for b in reversed(range(len(reducers))):
        for u, link in enumerate(reducers[b].links):
            chains.setdefault(link.name, []).append((b, u))
    started = {name: links[name].in_order([partial(gather, b, u) for b, u in order]) for name, order in chains.items()}
    position: dict[int, list[tuple[str, int]]] = {}
    for name, order in chains.items():
        for i, (b, _) in enumerate(order):
            position.setdefault(b, []).append((name, i))
    return Gathers(started, position)


# ----------------------------------------------- clipping from the shards
# After backward each rank holds only its shard of every bucket, so the global norm is summed from
# the shards (each rank its part, then one scalar all-reduce), over the elements that belong to the
# optimizer being clipped.

Segments = list[list[tuple[int, int, int]]]


def optimizer_segments(plan: BucketPlan, reducers: Sequence[StripedShards], optimizer: Optimizer) -> Segments:
    """Per bucket, the (piece, start, length) ranges of this rank's pieces (its shard of each unit)
    that belong to `optimizer`'s parameters."""
    members = {id(p) for g in optimizer.param_groups for p in g["params"]}
    per_bucket = []
    for bucket, reducer in zip(plan.buckets, reducers):
        ranges = []
        for i, (lo, piece) in enumerate(reducer.pieces()):
            hi = lo + piece.numel()
            for p, start in zip(bucket.params, bucket.offsets()):
                a, z = max(start, lo), min(start + p.numel(), hi)
                if id(p) in members and a < z:
                    ranges.append((i, a - lo, z - a))
        per_bucket.append(ranges)
    return per_bucket


def squared_norm(
    plan: BucketPlan,
    reducers: Sequence[StripedShards],
    segments: Segments,
    whole: bool,
    unscale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This rank's part of the squared global norm: its shards, or its slices of the whole gradients
    once someone read `.grad` (`whole`); `unscale`: fp16's 1/scale, not yet applied to the shards."""
    squares = torch.zeros(1, dtype=torch.float32, device=plan.buckets[0].buffer.device)
    for bucket, reducer, ranges in zip(plan.buckets, reducers, segments):
        pieces = [bucket.buffer.narrow(0, lo, shard.numel()) if whole else shard for lo, shard in reducer.pieces()]
        for i, start, length in ranges:
            piece = pieces[i].narrow(0, start, length)
            if unscale is not None:
                piece = piece.to(torch.float32) * unscale.to(piece.device)
            squares += torch.linalg.vector_norm(piece, dtype=torch.float32).square().to(squares.device)
    return squares
