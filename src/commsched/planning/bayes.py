"""Online tuning of the bucket size with Bayesian optimisation ([DeAR] §IV-C).

Expected Improvement (xi = 0.1) over the bucket size; the first trial is 25 MB. The search runs
over log2(size): 1-10 MB gets the same attention as 10-100 MB, where a linear domain would spend
most trials on large sizes that all behave alike. Many sizes give the same buckets (a model with
20 MB of gradients has one bucket at any size above that): a proposal whose buckets were already
measured is answered with that measurement instead of spending training steps on it, and tuning
ends early once the optimiser proposes nothing new. The tuner only decides; the strategy measures,
broadcasts and rebuilds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from bayes_opt import BayesianOptimization, acquisition

from commsched.options import TuningOptions

# proposals in a row that give already-measured buckets before the search counts as finished
MAX_REPEATED_PROPOSALS = 20


class BayesianSearch:
    """The project's one wrapper of `bayes_opt`: Expected Improvement over a box, minimising seconds.
    The bucket-size tuner and the stream search (`commsched.streams.techniques`) both use it."""

    def __init__(self, bounds: dict[str, tuple[float, float]], xi: float = 0.1, seed: int = 0) -> None:
        self._optimizer = BayesianOptimization(
            f=None,
            pbounds=bounds,
            acquisition_function=acquisition.ExpectedImprovement(xi=xi),
            random_state=seed,
            verbose=0,
            allow_duplicate_points=True,
        )

    def suggest(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._optimizer.suggest().items()}

    def register(self, params: dict[str, float], target: float) -> None:
        """`target`: the score to maximise (minus the seconds measured)."""
        self._optimizer.register(params=params, target=target)


@dataclass
class BucketSizeTrial:
    bucket_mb: float
    step_s: float


def _every_size_differs(bucket_mb: float) -> Hashable:
    return bucket_mb


@dataclass
class BucketSizeTuner:
    options: TuningOptions = field(default_factory=TuningOptions)
    seed: int = 0
    trials: list[BucketSizeTrial] = field(default_factory=list)
    # what a size turns into (the bucket layout); sizes with the same layout are measured once
    layout_of: Callable[[float], Hashable] = _every_size_differs

    def __post_init__(self) -> None:
        bounds = (math.log2(self.options.min_mb), math.log2(self.options.max_mb))
        self._optimizer = BayesianSearch({"log2_mb": bounds}, xi=self.options.xi, seed=self.seed)
        self._measured: dict[Hashable, float] = {}
        self._exhausted = False

    @property
    def done(self) -> bool:
        return self._exhausted or len(self.trials) >= self.options.trials

    def next_size(self) -> Optional[float]:
        """The next size worth measuring, or None (and `done`) when the optimiser keeps proposing measured layouts."""
        if not self.trials:
            return self.options.first_mb
        for _ in range(MAX_REPEATED_PROPOSALS):
            bucket_mb = 2 ** float(self._optimizer.suggest()["log2_mb"])
            known = self._measured.get(self.layout_of(bucket_mb))
            if known is None:
                return bucket_mb
            self._optimizer.register(params={"log2_mb": math.log2(bucket_mb)}, target=-known)
        self._exhausted = True
        return None

    def record(self, bucket_mb: float, step_s: float) -> None:
        self.trials.append(BucketSizeTrial(bucket_mb, step_s))
        self._measured[self.layout_of(bucket_mb)] = step_s
        self._optimizer.register(params={"log2_mb": math.log2(bucket_mb)}, target=-step_s)

    def best(self) -> BucketSizeTrial:
        return min(self.trials, key=lambda t: t.step_s)
