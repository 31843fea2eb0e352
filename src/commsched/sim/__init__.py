"""A scale simulator: predicted iteration time of each schedule at P = 2..2048 workers."""

from commsched.rates import parse_rate
from commsched.sim.cost_models import AlphaBeta, CostModel, Fitted, Line, Measured
from commsched.sim.simulate import SIM_SCHEDULES, simulate
from commsched.sim.workload import BUILTIN_WORKLOADS, Layer, Workload, builtin

__all__ = [
    "AlphaBeta",
    "BUILTIN_WORKLOADS",
    "CostModel",
    "Fitted",
    "Layer",
    "Line",
    "Measured",
    "SIM_SCHEDULES",
    "Workload",
    "builtin",
    "parse_rate",
    "simulate",
]
