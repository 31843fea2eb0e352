"""The search techniques the bandit chooses among ([AIACC] §V): grid, Bayesian optimisation (the
project's one `bayes_opt` wrapper) and a population-based search. Each proposes a configuration
not measured yet, or None when it has nothing new; every technique sees every measurement."""

from __future__ import annotations

import random
from typing import Optional

from commsched.planning.bayes import BayesianSearch
from commsched.reducers.units import Striping
from commsched.streams.space import Space

MAX_TRIES = 20


class Grid:
    """A coarse grid, walked in order: streams 1, 2, 4, 8, 16; every other unit size; each algorithm."""

    name = "grid"

    def __init__(self, space: Space, seed: int) -> None:
        coarse = [s for s in space.streams if s & (s - 1) == 0]
        units = space.units_mb[::2] if len(space.units_mb) > 2 else space.units_mb
        self._points = list(
            dict.fromkeys(space.canonical(Striping(s, u, h)) for h in space.hierarchical for s in coarse for u in units)
        )

    def propose(self, measured: dict[Striping, float]) -> Optional[Striping]:
        return next((p for p in self._points if p not in measured), None)

    def observe(self, striping: Striping, seconds: float) -> None:
        pass


class Bayesian:
    """Expected Improvement over (log2 S, log2 U[, two-level]), the proposal rounded to the nearest
    configuration; one already measured is told to the optimiser again and another asked for."""

    name = "bayes"

    def __init__(self, space: Space, seed: int) -> None:
        self._space = space
        self._search = BayesianSearch(space.bounds(), xi=0.01, seed=seed)
        self._seen = 0

    def propose(self, measured: dict[Striping, float]) -> Optional[Striping]:
        if self._seen < 2:  # the Gaussian process needs points before it can say anything
            return None
        for _ in range(MAX_TRIES):
            point = self._search.suggest()
            proposed = self._space.nearest(point)
            if proposed not in measured:
                return proposed
            # the suggested point rounds to a measured configuration: the optimiser learns that its
            # neighbourhood is worth that (at the unrounded point: no duplicate) and suggests again
            self._search.register(point, -measured[proposed])
        return None

    def observe(self, striping: Striping, seconds: float) -> None:
        self._seen += 1
        self._search.register(self._space.coordinates(striping), -seconds)


class Population:
    """Exploit and explore ([PBT]): a parent drawn from the best four measured (the best most often),
    moved one step in one dimension (`Space.neighbour`)."""

    name = "population"

    def __init__(self, space: Space, seed: int) -> None:
        self._space = space
        self._rng = random.Random(seed)

    def propose(self, measured: dict[Striping, float]) -> Optional[Striping]:
        if not measured:
            return None
        best = sorted(measured, key=measured.__getitem__)[:4]
        for _ in range(MAX_TRIES):
            parent = self._rng.choices(best, weights=range(len(best), 0, -1))[0]
            child = self._space.neighbour(parent, self._rng)
            if child not in measured:
                return child
        return None

    def observe(self, striping: Striping, seconds: float) -> None:
        pass


TECHNIQUES = (Grid, Bayesian, Population)
