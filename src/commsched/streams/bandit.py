"""The meta-solver of [AIACC] §V: a multi-armed bandit that picks which search technique proposes
the next configuration, credited by the area under its curve of new global bests (as OpenTuner's
AUC bandit, which the paper follows).

    score(t) = AUC_t + C * sqrt(2 * log2(|H|) / H_t)

over a sliding window H of the last uses: H_t of them were technique t's; AUC_t walks t's uses in
order, a use at position i (1-based) that found a new global best adds i, and the sum is divided
by n(n+1)/2 for n uses, so recent wins weigh most and a technique that always wins scores 1. A
technique not used in the window scores infinity (explored first, in the order given).
"""

from __future__ import annotations

import collections
import math
from typing import Sequence


class AUCBandit:
    def __init__(self, techniques: Sequence[str], exploration: float = 0.2, window: int = 25) -> None:
        self.techniques = list(techniques)
        self.exploration = exploration
        self.history: collections.deque[tuple[str, bool]] = collections.deque(maxlen=window)

    def uses(self, technique: str) -> int:
        return sum(1 for t, _ in self.history if t == technique)

    def auc(self, technique: str) -> float:
        position, area = 0, 0
        for t, new_best in self.history:
            if t == technique:
                position += 1
                area += position if new_best else 0
        return 2.0 * area / (position * (position + 1)) if position else 0.0

    def exploration_term(self, technique: str) -> float:
        uses = self.uses(technique)
        if uses == 0:
            return math.inf
        return math.sqrt(2.0 * math.log2(len(self.history)) / uses)

    def score(self, technique: str) -> float:
        return self.auc(technique) + self.exploration * self.exploration_term(technique)

    def ranked(self) -> list[str]:
        """Techniques best first (ties: the order given)."""
        return sorted(self.techniques, key=lambda t: (-self.score(t), self.techniques.index(t)))

    def choose(self) -> str:
        return self.ranked()[0]

    def record(self, technique: str, new_best: bool) -> None:
        self.history.append((technique, new_best))
