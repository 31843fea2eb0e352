"""Choosing fusion plans: from a model of a profiled run, by Bayesian tuning, or from a saved file."""

from commsched.planning.bayes import BucketSizeTuner
from commsched.planning.model_plans import plan_from_profile
from commsched.planning.plan_file import SavedPlan
from commsched.planning.policy import PLAN_FILE_NAME, PlanPolicy

__all__ = ["BucketSizeTuner", "PLAN_FILE_NAME", "PlanPolicy", "SavedPlan", "plan_from_profile"]
