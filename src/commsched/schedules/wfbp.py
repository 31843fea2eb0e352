"""WFBP: all-reduce each bucket as soon as backward has filled it (wait-free backpropagation).

This is DDP's schedule. After the closure every bucket holds the averaged gradient and each
parameter's `.grad` becomes a view into it, so clipping, `on_before_optimizer_step` and the
optimizer see exactly what they would see under DDP.
"""

from __future__ import annotations

from typing import Optional

from commsched.buckets import BucketPlan
from commsched.links import Link, Pending
from commsched.schedules.base import Schedule


class WFBPSchedule(Schedule):
    name = "wfbp"

    def __init__(self, plan: BucketPlan, link: Link) -> None:
        super().__init__(plan, link)
        self._works: list[Optional[Pending]] = [None] * len(plan.buckets)

    def _launch(self, b: int) -> None:
        self._works[b] = self.link.all_reduce(self.plan.buckets[b].buffer, f"bucket{b}")

    def _complete_reduction(self) -> None:
        for b, bucket in enumerate(self.plan.buckets):
            work = self._works[b]
            assert work is not None
            work.wait()
            self._works[b] = None
            for param, view, used in zip(bucket.params, bucket.views, self.globally_used[b]):
                param.grad = view if used else None
