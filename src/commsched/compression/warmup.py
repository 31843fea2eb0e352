"""The density's warm-up of a sparse exchange (Deep Gradient Compression, Lin et al. 2018, §3.4).

Early in training gradients are large and change fast; a sparse exchange then holds back a great
deal and sends it late. DGC raised the sparsity exponentially over the first epochs (75%, 93.75%,
98.4%, 99.6%, 99.9%: the density falls fourfold per epoch). Here the density starts at 1 (dense)
and falls fourfold per stage until it reaches the one asked for, over a span the run takes from its
own length: a quarter of it, at most four epochs (DGC's four). The steps are those of the optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

FALL = 4.0
"""The density divides by this from one stage to the next."""
AUTO_SHARE = 0.25
"""Share of the run the automatic warm-up spans..."""
AUTO_EPOCHS = 4
"""...at most this many epochs."""
UNKNOWN_LENGTH_STEPS = 1000
"""The span when neither the run's length nor its epoch's is known."""


def stage_densities(target: float) -> list[float]:
    """1, 1/4, 1/16, ... while above `target`, then `target`."""
    densities = [1.0]
    while densities[-1] / FALL > target:
        densities.append(densities[-1] / FALL)
    return densities + [target] if densities[-1] > target else densities


class SparsityWarmup:
    """The density of each optimizer step; `end` is the first step at the target density."""

    def __init__(self, target: float, start: int, span: Callable[[], tuple[int, str]]) -> None:
        self.target = target
        self.start = start
        self._span = span
        self._resolved: Optional[tuple[int, str]] = None
        self.stages = stage_densities(target)

    @classmethod
    def of(
        cls, compression: Any, epoch_steps: Callable[[], float], total_steps: Callable[[], float]
    ) -> Optional["SparsityWarmup"]:
        """The warm-up `compression.sparsity_warmup_steps` asks for (None: none), after any dense warm-up."""
        steps = compression.sparsity_warmup_steps
        if steps == 0 or compression.density >= 1 or (steps == "auto" and compression.dense_warmup_steps):
            return None
        if steps != "auto":
            return cls(compression.density, compression.dense_warmup_steps, lambda: (int(steps), "as set"))
        return cls(compression.density, 0, lambda: auto_span(epoch_steps(), total_steps()))

    @property
    def span(self) -> int:
        if self._resolved is None:  # read once training has started: the run's length is known then
            self._resolved = self._span()
        return self._resolved[0]

    @property
    def end(self) -> int:
        return self.start + self.span

    def density(self, step: int) -> float:
        into = step - self.start
        if into < 0 or into >= self.span:
            return self.target
        warm = len(self.stages) - 1  # stages before the target
        return self.stages[min(warm, into * warm // self.span)]

    def describe(self, sparse_below: float) -> str:
        span = self.span
        why = self._resolved[1] if self._resolved else ""
        per = span / max(1, len(self.stages) - 1)
        falls = " -> ".join(f"{d:g}" for d in self.stages)
        return (
            f"density warm-up {falls} over the first {span} optimizer steps ({why}; about {per:.0f} steps a stage; "
            f"densities of {sparse_below:g} or more exchange densely: sparse would send more)"
        )


def auto_span(epoch_steps: float, total_steps: float) -> tuple[int, str]:
    """A quarter of the run, at most four epochs (whichever lengths are known)."""
    candidates = []
    if math.isfinite(total_steps):
        candidates.append((int(AUTO_SHARE * total_steps), f"a quarter of this run's {int(total_steps)}"))
    if math.isfinite(epoch_steps):
        candidates.append((int(AUTO_EPOCHS * epoch_steps), f"{AUTO_EPOCHS} epochs of {int(epoch_steps)}"))
    if not candidates:
        return UNKNOWN_LENGTH_STEPS, "the run's length is unknown; compression.sparsity_warmup_steps sets it"
    return min(candidates)
