"""Choosing fusion plans: from a model of a profiled run, by Bayesian tuning, or from a saved file."""

from commsched.planning.bayes import BayesOptions, BucketSizeTuner
from commsched.planning.controller import PlanController
from commsched.planning.model_plans import plan_from_profile
from commsched.planning.plan_file import SavedPlan

__all__ = ["BayesOptions", "BucketSizeTuner", "PlanController", "SavedPlan", "plan_from_profile"]
