"""Each bucket's collectives timed in isolation on the real group: what the schedules' theoretical
bests ([DeAR] Eq. 7-8) and the overlap ratio are computed from."""

from __future__ import annotations

from typing import Sequence

import torch

from commsched.comm.buckets import BucketPlan
from commsched.comm.device_time import median_seconds
from commsched.comm.links import Link
from commsched.sim.cost_models import COLLECTIVES  # what every profile times: the planners' models read these three

__all__ = ["COLLECTIVES", "time_buckets", "time_collective"]


def time_collective(link: Link, collective: str, numel: int, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of one blocking collective over a buffer of `numel` elements (padded to the world size)."""
    world = link.world_size
    numel = -(-numel // world) * world
    full = torch.zeros(numel, dtype=dtype, device=link.device)
    shard = torch.zeros(numel // world, dtype=dtype, device=link.device)
    scratch = torch.empty_like(full)
    ops = {
        "all_reduce": lambda: link.all_reduce(full, "profile").wait(),
        "reduce_scatter": lambda: link.reduce_scatter(shard, full, "profile", scratch).wait(),
        "all_gather": lambda: link.all_gather(full, shard, "profile").wait(),
        "broadcast": lambda: link.broadcast(full, 0, "profile").wait(),
    }
    return median_seconds(ops[collective], repeats, device=link.device)


def time_buckets(
    plan: BucketPlan, link: Link, collectives: Sequence[str] = COLLECTIVES, repeats: int = 5
) -> list[dict[str, float]]:
    """Per bucket: seconds of each of `collectives` on its buffer, run alone."""
    return [
        {
            c: time_collective(link, c, bucket.buffer.numel(), repeats, link.wire_for(bucket.buffer.dtype))
            for c in collectives
        }
        for bucket in plan.buckets
    ]
