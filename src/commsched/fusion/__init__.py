"""Fusion planners: decide which trainable parameters share a communication bucket.

A planner sees the parameters in gradient-ready order (backward order) and returns contiguous
groups of their indices. Grouping changes how communication overlaps compute, never the math.
"""

from commsched.fusion.assigned import plan_assigned
from commsched.fusion.fixed import plan_fixed
from commsched.fusion.grouping import ParamInfo
from commsched.fusion.layers import plan_layers
from commsched.options import FUSION_POLICIES, MODEL_POLICIES

__all__ = ["FUSION_POLICIES", "MODEL_POLICIES", "ParamInfo", "plan_assigned", "plan_fixed", "plan_layers"]
