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

from commsched.buckets import BucketPlan
from commsched.links import Links
from commsched.options import CompressionOptions
from commsched.reducers import AllReduce, into_bucket
from commsched.reducers.hierarchical import HierarchicalReduce
from commsched.reducers.topk import SparseExchange, TopKAllReduce, selector
from commsched.schedules.base import Schedule
from commsched.sim import schedules
from commsched.sim.network import CostModel
from commsched.sim.schedules import Buckets, Result
from commsched.sim.workload import Workload
from commsched.say import say
from commsched.state import RESIDUAL_TOTAL


@dataclass
class WFBPSettings:
    """What the strategy hands WFBP: how buckets are exchanged, and where the run is."""

    compression: CompressionOptions = field(default_factory=CompressionOptions)
    """`hierarchical` resolved (never None here)."""
    progress: Callable[[], tuple[int, float]] = lambda: (0, math.inf)
    """(optimizer steps taken, steps the run will take): where the dense phases of a sparse exchange are."""


class WFBPSchedule(Schedule):
    name = "wfbp"
    description = "commsched WFBP: bucketed all-reduce launched during backward"
    step_collectives = ("all_reduce",)
    compresses = True

    def __init__(self, plan: BucketPlan, links: Links, settings: Any = None) -> None:
        super().__init__(plan, links, settings)
        self.settings: WFBPSettings = settings if isinstance(settings, WFBPSettings) else WFBPSettings()
        compression = self.settings.compression
        self._dense_phase: Optional[bool] = None
        self._carry: list[Optional[torch.Tensor]] = []
        """Residuals of a compressed run resumed dense: added to the first step's gradient."""
        sparse = compression.method != "none"
        select = selector(compression.method, compression.samplings) if sparse else None
        if compression.hierarchical:
            intra, inter = links["intra"], links["inter"]
            self.reducers = [HierarchicalReduce(b, intra, inter, compression.density if sparse else None, select,
                                                compression.error_feedback) for b in plan.buckets]
        elif sparse:
            self.reducers = [TopKAllReduce(b, self.link, compression.density, select, compression.error_feedback)
                             for b in plan.buckets]
        else:
            self.reducers = [AllReduce(b.buffer, self.link) for b in plan.buckets]
        self._works: list[Optional[SparseExchange | Any]] = [None] * len(plan.buckets)

    @classmethod
    def settings_for(cls, options: Any, trainer: Any, advance_schedulers: Callable[[], None]) -> Any:
        """The compression options, `hierarchical` resolved: by default, sparse exchanges go node first
        when the run has several nodes; dense ones stay DDP's flat all-reduce unless asked."""
        compression = options.compression
        if compression.hierarchical is None:
            compression = dataclasses.replace(compression, hierarchical=compression.method != "none" and trainer.num_nodes > 1)
        return WFBPSettings(compression, lambda: (trainer.global_step, trainer.estimated_stepping_batches))

    @classmethod
    def links_for(cls, settings: Any) -> tuple[str, ...]:
        hierarchical = isinstance(settings, WFBPSettings) and bool(settings.compression.hierarchical)
        return (*cls.links_used, "intra", "inter") if hierarchical else cls.links_used

    def at_boundary(self) -> None:
        """A sparse exchange's dense phases begin and end at iteration starts (every rank at the same step)."""
        compression = self.settings.compression
        if compression.method == "none" or not (compression.dense_warmup_steps or compression.dense_final_steps):
            return None
        step, total = self.settings.progress()
        dense = step < compression.dense_warmup_steps or step >= total - compression.dense_final_steps
        if dense != self._dense_phase:
            if self._dense_phase is not None or dense:
                say(f"commsched wfbp: step {step}: {'dense all-reduce' if dense else f'{compression.method} at density {compression.density:g}'}"
                    + (" (residuals join this step's gradient)" if dense and self._dense_phase is False and compression.error_feedback else ""))
            self._dense_phase = dense
            for reducer in self.reducers:
                reducer.dense = dense  # type: ignore[attr-defined]
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Residuals move with the run: by name (same world), re-sharded (`residual_total`, another
        world size), or, where this run exchanges dense gradients, into the first step's gradient."""
        saved = dict(state.get("reducers", {}))
        total = saved.pop(RESIDUAL_TOTAL, None)
        keeps = any("residual" in reducer.kinds for reducer in self.reducers)
        if not keeps and (total or "residual" in saved):
            owed, share = (total, self.link.world_size) if total else (saved.pop("residual"), 1)
            self._carry = [self._into_bucket(bucket, owed, share) for bucket in self.plan.buckets]
            say("commsched wfbp: this run exchanges dense gradients; the checkpoint's error-feedback residuals "
                "join the first step's gradient")
        super().load_state_dict({**state, "reducers": saved} if "reducers" in state else state)
        if keeps and total:
            for reducer in self.reducers:
                reducer.load_total(total)  # type: ignore[attr-defined]

    @staticmethod
    def _into_bucket(bucket: Any, saved: Any, share: int) -> torch.Tensor:
        flat = torch.zeros_like(bucket.buffer)
        into_bucket(bucket, saved, flat)
        return flat.div_(share)

    def _bucket_ready(self, b: int) -> None:
        if self._carry and self._carry[b] is not None:
            self.plan.buckets[b].buffer.add_(self._carry[b])
            self._carry[b] = None
        self._works[b] = self.reducers[b].start(f"bucket{b}")

    def _backward_end(self) -> None:
        for b, work in enumerate(self._works):
            assert work is not None
            work.wait()
            self._works[b] = None
        self.hand_back_gradients(range(len(self.plan.buckets)))

    @staticmethod
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """[DeAR] Eq. 7."""
        return t_ff + max(t_bp, totals["all_reduce"])

    @classmethod
    def simulate(cls, workload: Workload, network: CostModel, workers: int, buckets: Buckets) -> Result:
        return schedules.wfbp(workload, network, workers, buckets)
