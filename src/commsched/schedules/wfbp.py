"""WFBP: all-reduce each bucket as soon as backward has filled it (wait-free backpropagation).

This is DDP's schedule, and it ends the way DDP's does: at the end of backward (autograd's final
callback) it waits for every bucket and makes each parameter's `.grad` a view into its bucket, so
`on_after_backward`, clipping, `on_before_optimizer_step` and the optimizer see exactly what they
would see under DDP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from typing_extensions import override

from commsched.comm.buckets import BucketPlan
from commsched.comm.link_groups import Links
from commsched.compression.dgc import Corrections, OptimizerTerms, corrected, describe_corrections, export_momentum
from commsched.compression.selections import SELECTIONS, selector
from commsched.compression.sparse_or_dense import SparseOrDense, fastest_selection
from commsched.compression.warmup import SparsityWarmup
from commsched.errors import setting
from commsched.interleaved import MeasuredChoice
from commsched.loss_scale import inverse_scale, unscale_in_place
from commsched.options import BUILTIN, CompressionOptions, StrategyOptions, StreamOptions
from commsched.options.comm_hook import CommHook
from commsched.reducers import Reducer, into_bucket
from commsched.reducers.ddp_hook import CommHookReduce, HookChain
from commsched.reducers.dense import StripedAllReduce
from commsched.reducers.hierarchical import HierarchicalReduce, StripedTwoLevel
from commsched.reducers.hook_state import give_group, load_shared, shared_state
from commsched.reducers.topk import SparseExchange, TopKAllReduce
from commsched.reducers.units import Striping, plan_units
from commsched.say import say
from commsched.schedules.base import Schedule
from commsched.schedules.optimizer_step import run_with_step_replaced
from commsched.sim import timelines
from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Buckets, Result
from commsched.sim.workload import Workload
from commsched.state import RESIDUAL_TOTAL, refuse_unknown
from commsched.streams.control import StreamControl


@dataclass
class WFBPSettings:
    """What the strategy hands WFBP: how buckets are exchanged, and where the run is."""

    compression: CompressionOptions = field(default_factory=CompressionOptions)
    """`hierarchical` resolved (never None here)."""
    progress: Callable[[], tuple[int, float]] = lambda: (0, math.inf)
    """(optimizer steps taken, steps the run will take): where the dense phases of a sparse exchange are."""
    streams: Optional[StreamControl] = None
    """Dense buckets' units on several streams, fixed or searched (None: one stream)."""
    epoch_steps: Callable[[], float] = lambda: math.inf
    """Optimizer steps in one epoch (inf when the data has no length): the warm-up a sparse run is advised."""
    sparse_or_dense: Optional[SparseOrDense] = None
    """method "auto": whether sparse exchanges pay, decided on real steps (kept across bucket rebuilds)."""
    selection: dict[str, Any] = field(default_factory=dict)
    """method "auto": the selection measured faster ("method") and the times ("ms"), measured once per fit."""
    corrections: Optional[Corrections] = None
    """DGC's corrections of a sparse exchange (None: error feedback alone)."""
    warmup: Optional[SparsityWarmup] = None
    """The density's fall from dense to `compression.density` at the start of the run (None: none)."""
    comm_hook: Optional[CommHook] = None
    """A DDP communication hook that reduces each whole bucket instead of the all-reduce (None: none)."""


def warm_up_advice(epoch_steps: float, total_steps: float) -> str:
    """The dense warm-up suggested to a sparse run: one epoch, or a tenth of a run shorter than that."""
    if math.isfinite(epoch_steps) and epoch_steps < total_steps:
        return f"{setting('compression.dense_warmup_steps', int(epoch_steps))} (one epoch here)"
    if math.isfinite(total_steps):
        return (
            f"{setting('compression.dense_warmup_steps', max(1, int(total_steps) // 10))} "
            "(a tenth of this run, shorter than an epoch)"
        )
    return "a dense warm-up (compression.dense_warmup_steps) of about one epoch"


def _step_without(
    optimizer: Any, zeroed: tuple[str, ...], real_step: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    """`real_step` with the SGD terms the exchange applied set to 0 in every param group, then restored."""
    saved = [{key: group[key] for key in zeroed} for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update({key: 0.0 for key in zeroed})
    try:
        real_step(**kwargs)
    finally:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)


def _epoch_steps(batches: float, accumulate: int) -> float:
    return math.ceil(batches / max(1, accumulate)) if math.isfinite(batches) else math.inf


class WFBPSchedule(Schedule[WFBPSettings]):
    name = "wfbp"
    description = "commsched WFBP: bucketed all-reduce launched during backward"
    step_collectives = ("all_reduce",)
    compresses = BUILTIN["wfbp"].compresses  # the catalogue the options are checked against before torch is imported
    stripes = BUILTIN["wfbp"].stripes
    runs_comm_hooks = True

    def __init__(self, plan: BucketPlan, links: Links, settings: Any = None) -> None:
        super().__init__(plan, links, settings)
        self.settings: WFBPSettings = settings if isinstance(settings, WFBPSettings) else WFBPSettings()
        compression = self.settings.compression
        self._dense_phase: Optional[bool] = None
        self._advised = False
        self._carry: list[Optional[torch.Tensor]] = []
        """Residuals of a compressed run resumed dense: added to the first step's gradient."""
        sparse = compression.method != "none"
        select = selector(self._selection(), compression.samplings) if sparse else None
        if sparse and compression.hierarchical:
            intra, inter = links["intra"], links["inter"]
            self.reducers = [
                HierarchicalReduce(
                    b,
                    intra,
                    inter,
                    compression.density,
                    select,
                    compression.error_feedback,
                    compression.whole_vectors,
                    self.settings.corrections,
                )
                for b in plan.buckets
            ]
        elif sparse:
            self.reducers = [
                TopKAllReduce(
                    b,
                    self.link,
                    compression.density,
                    select,
                    compression.error_feedback,
                    compression.whole_vectors,
                    self.settings.corrections,
                )
                for b in plan.buckets
            ]
        self.streams = self.settings.streams or StreamControl(
            1, StreamOptions(), two_level=bool(compression.hierarchical)
        )
        if self.settings.comm_hook is not None:
            self.reducers = self._hook_reducers(self.settings.comm_hook)
        elif not sparse:
            self.reducers = self._dense_reducers(self.streams.striping)
        self._works: list[Optional[SparseExchange | Any]] = [None] * len(plan.buckets)
        self._inv_scale: Optional[torch.Tensor] = None  # fp16's 1/scale this step, under a sparse exchange
        self._found = torch.zeros(())
        self._before_step: list[torch.Tensor] = []

    def _selection(self) -> str:
        """The selection a sparse exchange uses: the method named, or for "auto" the one rank 0 measured
        faster on a tensor the size of the largest bucket (once per fit; every rank builds its buckets here)."""
        compression = self.settings.compression
        if compression.method != "auto":
            return compression.method
        chosen = self.settings.selection
        if not chosen:
            largest = max(b.buffer.numel() for b in self.plan.buckets)
            method, times = fastest_selection(
                largest,
                compression.density,
                compression.samplings,
                self.plan.buckets[0].buffer.device,
                self.links.control,
            )
            chosen.update(method=method, ms=times)
            measured = ", ".join(f"{times[m]:.2f} ms for {name}" for m, name in SELECTIONS.items())
            say(f"commsched topk: selecting with {SELECTIONS[method]} ({measured}, measured here)")
        return chosen["method"]

    def _dense_reducers(self, striping: Striping) -> list[Reducer]:
        """Each bucket's units on their streams, flat or node first (one unit per bucket with one stream)."""
        s, units = striping.streams, plan_units(self.plan, striping)
        if striping.hierarchical:
            intra, inter = self.links.streams("intra", s), self.links.streams("inter", s)
            return [StripedTwoLevel(b, u, intra, inter) for b, u in zip(self.plan.buckets, units)]
        return [StripedAllReduce(b, u, self.links.streams("primary", s)) for b, u in zip(self.plan.buckets, units)]

    def _hook_reducers(self, comm_hook: CommHook) -> list[CommHookReduce]:
        """The user's hook on each whole bucket, given the bucket undivided (averaging is the hook's, as under
        DDP). Where its state names no process group, its collectives go on a group of their own on the
        primary's network: issued from backward, they must never interleave with a link's own."""
        self.capture.divide_by_world_size(False)
        own = self.links.streams("primary", 2)[1]
        state = comm_hook.state if comm_hook.state is not None else own.group
        give_group(state, own.group)
        hook, last, chain = comm_hook.runnable(), len(self.plan.buckets) - 1, HookChain()
        return [CommHookReduce(b, hook, state, own, b.index == last, chain) for b in self.plan.buckets]

    @override
    def _restripe(self, striping: Striping) -> None:
        self.reducers = self._dense_reducers(striping)

    @classmethod
    @override
    def settings_for(
        cls, options: StrategyOptions, trainer: Any, advance_schedulers: Callable[[], None]
    ) -> WFBPSettings:
        """The compression options, `hierarchical` resolved: by default, sparse exchanges go node first
        when the run has several nodes; dense ones stay DDP's flat all-reduce unless asked, or unless
        `streams="auto"` finds node first faster (searched on several nodes when not set)."""
        compression = options.compression
        if compression.method != "none" and trainer.world_size == 1:
            say(
                f"commsched wfbp: one process has nothing to exchange: {compression.method} compression is off "
                "for this run"
            )
            compression = dataclasses.replace(compression, method="none", hierarchical=None)
        two_levels = trainer.num_nodes > 1 and trainer.num_devices > 1  # one worker per node: node first is flat
        searched = (
            options.streams.count == "auto"
            and compression.hierarchical is None
            and compression.method == "none"
            and two_levels
        )
        if compression.hierarchical and trainer.num_nodes > 1 and trainer.num_devices == 1:
            say("commsched wfbp: one worker per node: the two-level exchange is the flat one (hierarchical ignored)")
            compression = dataclasses.replace(compression, hierarchical=False)
        if compression.hierarchical is None:
            compression = dataclasses.replace(compression, hierarchical=compression.method != "none" and two_levels)
        streams = StreamControl.of(
            options.streams,
            trainer,
            two_level=None if searched else bool(compression.hierarchical),
        )
        judge = SparseOrDense(compression) if compression.method == "auto" else None
        sparse = compression.method != "none"
        corrections = None
        if (
            sparse
            and compression.error_feedback
            and (compression.momentum_correction or compression.decay_before_accumulation)
        ):
            by_norm = trainer.gradient_clip_algorithm in (None, "norm")  # Lightning's default algorithm is the norm
            clip = trainer.gradient_clip_val if compression.local_clipping and by_norm else None
            # without error feedback the unsent part of what joined the gradient is dropped: decay and
            # velocity would be lost with it, so the corrections need it
            corrections = Corrections(
                OptimizerTerms(lambda: trainer.strategy.optimizers),
                compression.momentum_correction,
                compression.momentum_masking,
                compression.decay_before_accumulation,
                float(clip) if clip else None,
            )
        epoch_steps = lambda: _epoch_steps(trainer.num_training_batches, trainer.accumulate_grad_batches)  # noqa: E731
        warmup = (
            SparsityWarmup.of(compression, epoch_steps, lambda: trainer.estimated_stepping_batches) if sparse else None
        )
        return WFBPSettings(
            compression,
            lambda: (trainer.global_step, trainer.estimated_stepping_batches),
            streams,
            epoch_steps,
            judge,
            corrections=corrections,
            warmup=warmup,
            comm_hook=options.comm_hook,
        )

    @classmethod
    @override
    def links_for(cls, settings: Any) -> tuple[str, ...]:
        hierarchical = isinstance(settings, WFBPSettings) and (
            bool(settings.compression.hierarchical)
            or (settings.streams is not None and settings.streams.may_use_two_level)
        )
        return (*cls.links_used, "intra", "inter") if hierarchical else cls.links_used

    @override
    def at_boundary(self) -> None:
        """The stream search's switches, and a sparse exchange's dense phases, at iteration starts
        (every rank at the same step; nothing is in flight)."""
        if self.streams is not None:
            self._follow_streams()
        compression = self.settings.compression
        if compression.method == "none":
            return None
        if self.settings.corrections is not None:
            self.settings.corrections.terms.refresh()  # param groups added or replaced since the last step
        if not self._advised:
            self._advise_warm_up()
        step, total = self.settings.progress()
        phased = bool(compression.dense_warmup_steps or compression.dense_final_steps)
        dense = phased and (step < compression.dense_warmup_steps or step >= total - compression.dense_final_steps)
        if phased and dense != self._dense_phase:
            if self._dense_phase is not None or dense:
                say(
                    f"commsched wfbp: step {step}: "
                    f"{'dense all-reduce' if dense else f'{compression.method} at density {compression.density:g}'}"
                    + (
                        " (residuals join this step's gradient)"
                        if dense and self._dense_phase is False and compression.error_feedback
                        else ""
                    )
                )
            self._dense_phase = dense
        warmup = self.settings.warmup
        density = warmup.density(step) if warmup is not None else compression.density
        for reducer in self.reducers:
            reducer.set_density(density)  # type: ignore[attr-defined]
        dense = dense or density >= self._sparse_pays_below
        judge = self.settings.sparse_or_dense
        if judge is not None and not dense and not self.settling and not self._warming(step):
            judge.at_boundary(self.links.control, say)
        dense = dense or (judge is not None and judge.dense)
        for reducer in self.reducers:
            reducer.dense = dense  # type: ignore[attr-defined]
        return None

    @property
    def _sparse_pays_below(self) -> float:
        """Densities of 1/P or more send at least what the dense all-reduce among the P ranks of the exchange sends
        (every rank gathers P x 2 x density of the bucket; a ring all-reduce moves 2 (P - 1) / P)."""
        exchange = self.links["inter"] if self.settings.compression.hierarchical else self.link
        return 1.0 / max(2, exchange.world_size)

    def _warming(self, step: int) -> bool:
        return self.settings.warmup is not None and step < self.settings.warmup.end

    @override
    def choices(self) -> dict[str, MeasuredChoice]:
        judge = self.settings.sparse_or_dense
        return {"sparse_or_dense": judge.choice} if judge is not None else {}

    @property
    @override
    def settled(self) -> bool:
        judge = self.settings.sparse_or_dense
        step, _ = self.settings.progress()
        return super().settled and (judge is None or not judge.deciding) and not self._warming(step)

    def _corrects(self, optimizer: Any) -> bool:
        corrections = self.settings.corrections
        return corrections is not None and corrected(optimizer) and self.settings.compression.method != "none"

    @override
    def optimizer_step(self, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """Under DGC's corrections the exchanged update already moved with momentum and decay: the
        user's SGD steps with momentum 0 and weight decay 0. Its step hooks run once, around the
        whole step, and see the param groups as the user set them (as do schedulers and callbacks)."""
        if not self._corrects(optimizer):
            return run_step()
        corrections = self.settings.corrections
        zeroed = ("momentum",) * corrections.momentum + ("weight_decay",) * corrections.decay
        return run_with_step_replaced(
            optimizer, run_step, lambda real_step, kwargs: _step_without(optimizer, zeroed, real_step, kwargs)
        )

    @override
    def optimizer_state(self, optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
        """Under momentum correction the momentum is in the ranks' velocities: summed over the ranks (one
        all-reduce on the default group, as the checkpoint's gather, which also serves after the fit),
        they become the checkpoint's `momentum_buffer`s, so a run resumed under ddp keeps its momentum
        (`export_momentum`)."""
        corrections = self.settings.corrections
        if not self._corrects(optimizer) or not corrections.momentum:
            return saved
        kept = {name: t for reducer in self.reducers for name, t in reducer.state_dict().get("momentum", {}).items()}
        params = [(name, p) for bucket in self.plan.buckets for name, p in zip(bucket.names, bucket.params)]
        flat = torch.cat([kept[name].reshape(-1) if name in kept else p.new_zeros(p.numel()) for name, p in params])
        dist.all_reduce(flat)
        summed = {id(p): t for (_, p), t in zip(params, flat.split([p.numel() for _, p in params]))}
        return export_momentum(optimizer, saved, summed, corrections.terms)

    @override
    def clip_gradients(self, optimizer: Any, clip_val: float, algorithm: str) -> Optional[torch.Tensor]:
        """Clipping by norm already ran on each rank before accumulation (DGC's local clipping)."""
        corrections = self.settings.corrections
        if (
            algorithm == "norm"
            and corrections is not None
            and corrections.clip_norm is not None
            and corrected(optimizer)
        ):
            return None
        return super().clip_gradients(optimizer, clip_val, algorithm)

    @override
    def summary(self) -> list[str]:
        compression = self.settings.compression
        if compression.method == "none":
            return super().summary()
        how = "node first (HiTopKComm)" if compression.hierarchical else "flat"
        feedback = "with" if compression.error_feedback else "without"
        method = compression.method
        if method == "auto":
            method = f"top-k ({self.settings.selection.get('method', 'topk')} selection)"
        judge = self.settings.sparse_or_dense
        kept = f"; {judge.describe()}" if judge is not None else ""
        corrections = (
            f"; {describe_corrections(self.settings.corrections, self._optimizers())}"
            if self.settings.corrections
            else ""
        )
        return [
            f"{method} at density {compression.density:g}, {how}, {feedback} error feedback{corrections}{kept}",
            *super().summary(),
        ]

    def _optimizers(self) -> list[Any]:
        corrections = self.settings.corrections
        return list(corrections.terms.optimizers()) if corrections is not None else []

    def _advise_warm_up(self) -> None:
        """Say once, at the start, what a sparse run does beyond the selection: DGC's corrections and the
        density's warm-up. A run that turned every warm-up off converges worse (early gradients are
        large and momentum carries a late residual as one stale update): it is told so, with this
        run's numbers, rather than changed."""
        self._advised = True
        step, total = self.settings.progress()
        if step > 0 or self.settings.compression.density >= 1:
            return  # a resumed run (it was said when it started), or one that sends everything
        if self.settings.corrections is not None:
            say(f"commsched topk: {describe_corrections(self.settings.corrections, self._optimizers())}")
        if self.settings.warmup is not None:
            say(f"commsched topk: {self.settings.warmup.describe(self._sparse_pays_below)}")
            return
        if self.settings.compression.dense_warmup_steps:
            return
        method = {"auto": "top-k"}.get(self.settings.compression.method, self.settings.compression.method)
        say(
            f"commsched wfbp: {method} from the first step, with no dense warm-up; sparse "
            "exchanges with momentum go wrong early in training (in the digits runs of docs/compression.md "
            "a dense first epoch recovered 2-5 of the points top-k lost): consider "
            f"{warm_up_advice(self.settings.epoch_steps(), total)}"
        )

    @classmethod
    @override
    def keeps_its_buckets(cls, options: StrategyOptions) -> bool:
        return options.comm_hook is not None  # a hook's state is per bucket (PowerSGD's Q), as under DDP

    @override
    def state_dict(self) -> dict[str, Any]:
        """The reducers' state, and a DDP hook's state equal on every rank (PowerSGD's Q, step count, random state)."""
        saved = super().state_dict()
        hook = self.settings.comm_hook
        shared = shared_state(hook.state, self.plan) if hook is not None else {}
        if shared:
            saved.setdefault("shared", {})["comm_hook"] = shared
        return saved

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Residuals move with the run: by name (same world), re-sharded (`residual_total`, another
        world size), or, where this run exchanges dense gradients, into the first step's gradient."""
        state = dict(state)
        hook_state = state.pop("comm_hook", None)
        if hook_state and self.settings.comm_hook is None:
            refuse_unknown(self.name, {"comm_hook": hook_state}, ())
        if self.settings.comm_hook is not None:
            load_shared(self.settings.comm_hook.state, hook_state, self.plan)
        saved = dict(state.get("reducers", {}))
        totals = saved.pop(RESIDUAL_TOTAL, None)
        keeps = any("residual" in reducer.kinds for reducer in self.reducers)
        if totals and "momentum" in totals and not any("momentum" in reducer.kinds for reducer in self.reducers):
            refuse_unknown(self.name, {"momentum": totals["momentum"]}, ())
        total = totals.get("residual") if totals else None
        if not keeps and (total or "residual" in saved):
            owed, share = (total, self.link.world_size) if total else (saved.pop("residual"), 1)
            self._carry = [self._into_bucket(bucket, owed, share) for bucket in self.plan.buckets]
            say(
                "commsched wfbp: this run exchanges dense gradients; the checkpoint's error-feedback residuals "
                "join the first step's gradient"
            )
        super().load_state_dict({**state, "reducers": saved} if "reducers" in state else state)
        for reducer in self.reducers:
            if totals and set(reducer.kinds) & set(totals):
                reducer.load_total(totals)  # type: ignore[attr-defined]

    @staticmethod
    def _into_bucket(bucket: Any, saved: Any, share: int) -> torch.Tensor:
        flat = torch.zeros_like(bucket.buffer)
        into_bucket(bucket, saved, flat)
        return flat.div_(share)

    @override
    def on_bucket_ready(self, b: int) -> None:
        if self.loss_scaler is not None and self.settings.compression.method != "none":
            self._unscale_before_exchange(b)
        if self._carry and self._carry[b] is not None:
            scaled = self.loss_scaler is not None and self.settings.compression.method == "none"
            carry = self._carry[b] * self.loss_scaler.get_scale() if scaled else self._carry[b]  # as the gradient is
            if self.settings.comm_hook is not None:
                carry = carry * self.plan.world_size  # a hook's bucket is not divided by the world size
            self.plan.buckets[b].buffer.add_(carry)
            self._carry[b] = None
        self._works[b] = self.reducers[b].start(f"bucket{b}")

    def _unscale_before_exchange(self, b: int) -> None:
        """fp16's scaler under a sparse exchange: residuals and velocities are kept across steps, so what
        joins them is unscaled first (scales change between steps), and what they held before this step
        is copied, to be put back if any rank's gradient had an inf (the scaler then skips the step)."""
        if b == 0:
            self._inv_scale = inverse_scale(self.loss_scaler)
            self._found = torch.zeros((), dtype=torch.float32, device=self.plan.buckets[0].buffer.device)
            self._before_step = [t.clone() for reducer in self.reducers for t in reducer.live_state()]
        self._found = torch.maximum(self._found, unscale_in_place([self.plan.buckets[b].buffer], self._inv_scale))

    @override
    def unscale_gradients(self, optimizer: Any, inv_scale: torch.Tensor) -> Optional[torch.Tensor]:
        """Dense: torch's scaler unscales `.grad` itself. Sparse: unscaled before the exchange; a step
        with an inf on any rank leaves residuals and velocities as they were before it."""
        if self.settings.compression.method == "none":
            return None
        found = self.agreed(self._found)
        if found.item():
            live = [t for reducer in self.reducers for t in reducer.live_state()]
            for kept, before in zip(live, self._before_step):
                kept.copy_(before)
        return found

    @override
    def skips_idle_buckets(self) -> bool:
        """Dense whole-bucket all-reduces only: a sparse exchange's residuals and a communication hook's state
        (PowerSGD's error feedback) change even on a bucket of zeros, as they do under DDP."""
        return self.settings.compression.method == "none" and self.settings.comm_hook is None

    @override
    def on_backward_end(self) -> None:
        for b, work in enumerate(self._works):
            if b in self.capture.idle:
                continue
            assert work is not None
            work.wait()
            self._works[b] = None
        self.hand_back_gradients(range(len(self.plan.buckets)))

    @staticmethod
    @override
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """[DeAR] Eq. 7."""
        return t_ff + max(t_bp, totals["all_reduce"])

    @classmethod
    @override
    def simulate(cls, workload: Workload, network: CostModel, workers: int, buckets: Buckets) -> Result:
        return timelines.wfbp(workload, network, workers, buckets)
