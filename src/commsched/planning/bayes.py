"""Online tuning of the bucket size with Bayesian optimisation (DESIGN.md §5, dear.txt §IV-C).

Expected Improvement (xi = 0.1) over the bucket size; the first trial is 25 MB. The search runs
over log2(size): 1-10 MB gets the same attention as 10-100 MB, where a linear domain would spend
most trials on large sizes that all behave alike. The tuner only decides; the strategy measures,
broadcasts and rebuilds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bayes_opt import BayesianOptimization, acquisition


@dataclass
class Trial:
    bucket_mb: float
    step_s: float


@dataclass(frozen=True)
class BayesOptions:
    """The tuning run: `trials` trials, each `trial_steps` timed steps after `warmup_steps`."""

    trials: int = 10
    warmup_steps: int = 2
    trial_steps: int = 10
    min_mb: float = 1.0
    max_mb: float = 100.0
    first_mb: float = 25.0
    xi: float = 0.1


@dataclass
class BucketSizeTuner:
    options: BayesOptions = field(default_factory=BayesOptions)
    seed: int = 0
    trials: list[Trial] = field(default_factory=list)

    def __post_init__(self) -> None:
        bounds = (math.log2(self.options.min_mb), math.log2(self.options.max_mb))
        self._optimizer = BayesianOptimization(
            f=None, pbounds={"log2_mb": bounds}, acquisition_function=acquisition.ExpectedImprovement(xi=self.options.xi),
            random_state=self.seed, verbose=0, allow_duplicate_points=True,
        )

    @property
    def done(self) -> bool:
        return len(self.trials) >= self.options.trials

    def next_size(self) -> float:
        if not self.trials:
            return self.options.first_mb
        return 2 ** float(self._optimizer.suggest()["log2_mb"])

    def record(self, bucket_mb: float, step_s: float) -> None:
        self.trials.append(Trial(bucket_mb, step_s))
        self._optimizer.register(params={"log2_mb": math.log2(bucket_mb)}, target=-step_s)

    def best(self) -> Trial:
        return min(self.trials, key=lambda t: t.step_s)
