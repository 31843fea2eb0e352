"""Fixed-size fusion: close a bucket when the next tensor would take it past `cap_bytes` (DDP's rule).

Like DDP, the first bucket (the last layers, whose gradients are ready first) has its own, smaller
cap, so that communication starts early in backward even when `cap_bytes` would fit the whole model.
"""

from __future__ import annotations

from typing import Optional, Sequence

from commsched.fusion.grouping import ParamInfo, group_contiguous

DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES


def plan_fixed(params: Sequence[ParamInfo], cap_bytes: int, first_cap_bytes: Optional[int] = None) -> list[list[int]]:
    """Greedy contiguous packing; a tensor larger than the cap gets a bucket of its own.

    `first_cap_bytes` (default: the smaller of `cap_bytes` and 1 MiB) bounds the first bucket only.
    """
    first_cap = min(cap_bytes, DDP_FIRST_BUCKET_BYTES) if first_cap_bytes is None else first_cap_bytes
    def cut_before(run: list[int], i: int) -> bool:
        cap = first_cap if run[0] == 0 else cap_bytes
        return sum(params[j].nbytes for j in run) + params[i].nbytes > cap

    return group_contiguous(params, cut_before)
