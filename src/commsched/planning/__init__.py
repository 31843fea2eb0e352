"""Choosing fusion plans: from a model of a profiled run, by Bayesian tuning, or from a saved file.
The plan policy used during training lives in `commsched.planning.policy` (it needs torch)."""

from commsched.planning.model_plans import plan_from_profile
from commsched.planning.plan_file import SavedPlan

__all__ = ["SavedPlan", "plan_from_profile"]
