"""A schedule added from outside the package, as a contributor would: WFBP that also keeps, per rank,
the running sum of this rank's own (unreduced) gradients, the shape of an error-feedback residual.

It exercises the engine's extension points: the registry (`commsched.register_schedule`), per-rank communication
state keyed by parameter name (saved per rank in checkpoints, carried across bucket rebuilds,
refused at another world size).
"""

from __future__ import annotations

from typing import Any

import torch

import commsched


@commsched.register_schedule
class LocalSumWFBP(commsched.SCHEDULES["wfbp"]):
    name = "localsum"
    description = "test schedule: wfbp plus a per-rank sum of local gradients"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.local_sum: dict[str, torch.Tensor] = {}

    def _bucket_ready(self, b: int) -> None:
        bucket = self.plan.buckets[b]
        for name, view in zip(bucket.names, bucket.views):  # this rank's gradient / P, before the all-reduce
            total = self.local_sum.setdefault(name, torch.zeros_like(view))
            total.add_(view, alpha=self.plan.world_size)
        super()._bucket_ready(b)

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": {"local_sum": {name: t.clone() for name, t in self.local_sum.items()}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_sum = {name: t.clone() for name, t in state.get("local_sum", {}).items()}

