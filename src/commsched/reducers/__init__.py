"""How one bucket's bytes are combined across ranks: a reducer object per bucket, chosen by the schedule.

`AllReduce` (wfbp, DeFT) sums a bucket in one collective; `ShardedReduce` (DeAR) splits it into a
reduce-scatter and an all-gather the schedule starts at different times. Sparse top-k and
hierarchical exchanges are further reducers with the same shape: they keep their per-rank state
(error-feedback residuals) by parameter name (`reducers.base`).
"""

from commsched.reducers.base import Reducer, ReducerState, by_parameter, into_bucket
from commsched.reducers.dense import AllReduce, ShardedReduce

__all__ = ["AllReduce", "Reducer", "ReducerState", "ShardedReduce", "by_parameter", "into_bucket"]
