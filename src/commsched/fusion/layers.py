"""N-layers fusion: every bucket holds the parameters of `layers_per_bucket` consecutive layers."""

from __future__ import annotations

from typing import Sequence

from commsched.fusion.grouping import ParamInfo, group_contiguous


def plan_layers(params: Sequence[ParamInfo], layers_per_bucket: int) -> list[list[int]]:
    """A "layer" is a module owning parameters directly; tied parameters count for their first owner."""

    def cut_before(run: list[int], i: int) -> bool:
        layers_in_run = {params[j].layer for j in run}
        return params[i].layer not in layers_in_run and len(layers_in_run) >= layers_per_bucket

    return group_contiguous(params, cut_before)
