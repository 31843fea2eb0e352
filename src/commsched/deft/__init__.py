"""DeFT ([DeFT] Yu et al.): knapsack solvers, the periodic plan, the Gaussian-walk Preserver.

The runtime is `commsched.schedules.deft`; everything here is pure (solvers, plan, walk) except
the Preserver callback and the in-run measurements.
"""
