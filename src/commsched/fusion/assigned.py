"""A plan decided elsewhere (a model planner, Bayesian tuning, a saved file), applied to the parameters."""

from __future__ import annotations

from typing import Mapping, Sequence

from commsched.fusion.grouping import ParamInfo, group_contiguous


def plan_assigned(params: Sequence[ParamInfo], bucket_of: Mapping[str, int]) -> list[list[int]]:
    """Cut wherever the assigned bucket changes; a parameter the plan does not name stays with the
    run it follows (e.g. a plan saved before a layer was unfrozen)."""

    def cut_before(run: list[int], i: int) -> bool:
        name = params[i].name
        return name in bucket_of and any(
            params[j].name in bucket_of and bucket_of[params[j].name] != bucket_of[name] for j in run[-1:]
        )

    return group_contiguous(params, cut_before)
