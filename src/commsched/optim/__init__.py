"""Optimizers that know they run data-parallel: LARS with its per-layer norms computed in parallel."""

from commsched.optim.lars import LARS

__all__ = ["LARS"]
