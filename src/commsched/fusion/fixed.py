"""Fixed-size fusion: close a bucket when the next tensor would take it past `cap_bytes` (DDP's rule)."""

from __future__ import annotations

from typing import Sequence

from commsched.fusion.grouping import ParamInfo, group_contiguous


def plan_fixed(params: Sequence[ParamInfo], cap_bytes: int) -> list[list[int]]:
    """Greedy contiguous packing; a tensor larger than the cap gets a bucket of its own."""

    def cut_before(run: list[int], i: int) -> bool:
        return sum(params[j].nbytes for j in run) + params[i].nbytes > cap_bytes

    return group_contiguous(params, cut_before)
