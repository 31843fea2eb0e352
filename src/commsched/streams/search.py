"""The stream search ([AIACC] §V): the bandit picks a technique, the technique proposes a
configuration, the run measures it, everyone hears the result. Pure: no torch, no clock; the
in-run control (`control`) times the steps and the tests drive it with synthetic costs."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

from commsched.reducers.units import Striping
from commsched.streams.bandit import AUCBandit
from commsched.streams.space import Space
from commsched.streams.techniques import TECHNIQUES


@dataclass
class StreamTrial:
    technique: str
    striping: Striping
    seconds: float
    new_best: bool

    def to_json(self) -> dict:
        return {
            "technique": self.technique,
            **self.striping.to_json(),
            "step_s": self.seconds,
            "new_best": self.new_best,
        }


class StreamSearch:
    def __init__(
        self, space: Space, first: Sequence[Striping] = (), exploration: float = 0.2, window: int = 25, seed: int = 0
    ) -> None:
        """`first`: measured before the bandit starts, in order ("start"; one stream among them is the
        baseline every choice must beat)."""
        self.space = space
        self._first = [space.canonical(s) for s in first]
        self._techniques = {t.name: t(space, seed) for t in TECHNIQUES}
        self.bandit = AUCBandit(list(self._techniques), exploration, window)
        self._rng = random.Random(seed + 1)
        self.measured: dict[Striping, float] = {}
        self.trials: list[StreamTrial] = []

    def propose(self) -> tuple[str, Optional[Striping]]:
        """(technique, configuration to measure next); None: every configuration is measured."""
        while self._first:
            s = self._first.pop(0)
            if s not in self.measured:
                return "start", s
        for name in self.bandit.ranked():
            proposed = self._techniques[name].propose(self.measured)
            if proposed is not None:
                return name, proposed
        left = self.space.random_unmeasured(self.measured, self._rng)
        return "random", left

    def record(self, technique: str, striping: Striping, seconds: float) -> StreamTrial:
        best = self.best()
        new_best = best is None or seconds < best[1]
        self.measured[striping] = seconds
        for t in self._techniques.values():
            t.observe(striping, seconds)
        if technique in self._techniques:
            self.bandit.record(technique, new_best)
        trial = StreamTrial(technique, striping, seconds, new_best)
        self.trials.append(trial)
        return trial

    def best(self) -> Optional[tuple[Striping, float]]:
        if not self.measured:
            return None
        s = min(self.measured, key=self.measured.__getitem__)
        return s, self.measured[s]
