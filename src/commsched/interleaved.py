"""Choosing between configurations on real training steps, robust to a noisy machine.

Every automatic choice commsched makes (planned buckets or fixed ones, sparse or dense exchanges,
several streams or one, DeFT's plan or an exact schedule) is a claim that one configuration runs
faster than the simple default. Measured once each, one after the other, a drift in the machine
(another job, a throttled core, the data loader warming its cache) reads as a difference between
them: Horovod's autotune picks the best of noisy samples and users report 7% spreads between
near-identical settings. So the arms take turns (A B A B ...), the first step after each switch is
left out (it pays for the switch), every rank's step times are combined as the slowest rank's
(a step is as slow as its slowest rank) so that all ranks reach the same verdict, and a candidate
replaces the default only if it beats it by more than the noise measured in these very steps:
two standard errors of the difference of the medians, from the steps' own spread. Ties go to the
default, the simpler configuration.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

MIN_MARGIN = 0.01
"""A candidate must win by at least 1% even on a perfectly quiet machine: less is not worth a change."""
MEDIAN_EFFICIENCY = 1.2533
"""Standard error of a median over that of a mean, for normal noise (sqrt(pi / 2))."""


@dataclass(frozen=True)
class Verdict:
    """What the measured steps say: `keep` is the index of the arm kept (0: the default)."""

    keep: int
    medians_s: list[float]
    margin: float
    """The relative gain a candidate needed (from the spread of the steps, at least `MIN_MARGIN`)."""
    steps: int
    """Training steps the comparison took, switches included."""

    @property
    def gain(self) -> float:
        """How much faster the kept arm ran than the default (1.0 when the default is kept)."""
        return self.medians_s[0] / self.medians_s[self.keep]


def relative_spread(samples: Sequence[Sequence[float]]) -> float:
    """The steps' coefficient of variation, pooled over the arms, from the median absolute deviation
    (one slow step, a garbage collection, does not inflate it as it would a standard deviation)."""
    deviations = [abs(t / statistics.median(arm) - 1.0) for arm in samples if arm for t in arm]
    return 1.4826 * statistics.median(deviations) if deviations else 0.0


def decide(samples: Sequence[Sequence[float]], steps: int = 0, min_margin: float = MIN_MARGIN) -> Verdict:
    """Arm 0 is the default. The fastest other arm is kept only if its median step is faster than
    the default's by more than `margin`: two standard errors of the relative difference of two
    medians of n steps each (2 x 1.2533 x sqrt(2 / n) x the steps' relative spread)."""
    if len(samples) < 2 or any(not arm for arm in samples):
        raise ValueError("every arm needs at least one timed step")
    medians = [statistics.median(arm) for arm in samples]
    n = min(len(arm) for arm in samples)
    margin = max(min_margin, 2.0 * MEDIAN_EFFICIENCY * math.sqrt(2.0 / n) * relative_spread(samples))
    best = min(range(1, len(samples)), key=medians.__getitem__)
    keep = best if medians[best] < medians[0] * (1.0 - margin) else 0
    return Verdict(keep, medians, margin, steps)


@dataclass
class Turns:
    """The arms' turns on real steps. Every rank calls `at_boundary()` at every iteration start (the
    same iterations on every rank) and switches to the arm it returns; when the last turn ended,
    `samples()` holds each arm's step times on this rank, ready to be combined across ranks."""

    arms: int
    steps_per_turn: int = 3
    """Timed steps per turn; one more runs first and is left out (the switch)."""
    rounds: int = 3
    """Turns each arm takes."""
    _order: list[int] = field(init=False)
    _seconds: list[list[float]] = field(init=False)
    _turn: int = field(init=False, default=-1)
    _in_turn: int = field(init=False, default=0)
    _stamp: Optional[float] = field(init=False, default=None)
    steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.arms < 2 or self.steps_per_turn < 1 or self.rounds < 1:
            raise ValueError("two arms or more, one step per turn or more, one round or more")
        self._order = [arm for _ in range(self.rounds) for arm in range(self.arms)]
        self._seconds = [[] for _ in range(self.arms)]

    @property
    def done(self) -> bool:
        return self._turn >= len(self._order)

    @property
    def running(self) -> int:
        return self._order[min(max(self._turn, 0), len(self._order) - 1)]

    def at_boundary(self, now: Optional[float] = None) -> Optional[int]:
        """The arm to switch to now, or None to go on (also None once done: read `samples`)."""
        now = time.perf_counter() if now is None else now
        if self.done:
            return None
        if self._stamp is not None:
            self.steps += 1
            if self._in_turn > 0:  # the first step of a turn pays for the switch
                self._seconds[self.running].append(now - self._stamp)
            self._in_turn += 1
        self._stamp = now
        if self._turn >= 0 and self._in_turn <= self.steps_per_turn:
            return None
        self._turn += 1
        self._in_turn = 0
        if self.done:
            self._stamp = None
            return None
        return self._order[self._turn]

    def samples(self) -> list[list[float]]:
        return [list(arm) for arm in self._seconds]


def slowest_rank(samples: list[list[float]], control: Any) -> list[list[float]]:
    """Each step's time as the slowest rank measured it (an all-reduce MAX on `control`, a
    `commsched.comm.links.Link`): every rank then holds the same numbers and reaches the same verdict."""
    import torch

    sizes = [len(arm) for arm in samples]
    flat = control.tensor([t for arm in samples for t in arm], torch.float64)
    control.all_reduce(flat, "interleaved-steps", op=torch.distributed.ReduceOp.MAX).wait()
    values, out, start = flat.tolist(), [], 0
    for size in sizes:
        out.append(values[start : start + size])
        start += size
    return out


class DriftWatch:
    """After a choice: True (on every rank at once) when the median step over `steps` iterations is
    more than `drift` slower than the kept configuration measured; the choice should then be made
    again. Rank 0's clock decides and one small broadcast per `steps` iterations carries it."""

    def __init__(self, kept_s: float, drift: float, steps: int) -> None:
        self.kept_s, self.drift, self.steps = kept_s, drift, steps
        self._seconds: list[float] = []
        self._stamp: Optional[float] = None

    def at_boundary(self, control: Any, now: Optional[float] = None) -> bool:
        if not self.drift:
            return False
        now = time.perf_counter() if now is None else now
        if self._stamp is not None:
            self._seconds.append(now - self._stamp)
        self._stamp = now
        if len(self._seconds) < self.steps:
            return False
        median, self._seconds = statistics.median(self._seconds), []
        slower = median > self.kept_s * (1.0 + self.drift)
        return bool(control.broadcast_object(slower if control.rank == 0 else None, 0, "drift"))


class Choice:
    """The default (arm 0) or a candidate (arm 1), chosen on real steps after `warmup` iterations and
    chosen again when the steps drift. Every rank calls `at_boundary` at every iteration start and
    runs the arm it returns; `verdict` holds the last choice's measurements."""

    def __init__(self, confirm_steps: int, confirm_rounds: int, drift: float, drift_steps: int, warmup: int = 5) -> None:
        self.confirm_steps, self.confirm_rounds, self.drift, self.drift_steps, self.warmup = (
            confirm_steps, confirm_rounds, drift, drift_steps, warmup)
        self.arm = 1  # the candidate runs until it is measured
        self.verdict: Optional[Verdict] = None
        self.reopened = 0
        """Choices made again after a drift."""
        self._warming = 0
        self._turns: Optional[Turns] = None
        self._drift: Optional[DriftWatch] = None

    @property
    def deciding(self) -> bool:
        return self.verdict is None

    def at_boundary(self, control: Any) -> Optional[int]:
        """The arm to run from this iteration on (None: the one running). Reads `reopened` to tell a
        drift's new comparison from the first."""
        if self.verdict is not None:
            if self._drift is None or not self._drift.at_boundary(control):
                return None
            self.verdict, self._drift, self._warming = None, None, self.warmup
            self.reopened += 1
        if self._warming < self.warmup:
            self._warming += 1
            return None
        if self._turns is None:
            self._turns = Turns(arms=2, steps_per_turn=self.confirm_steps, rounds=self.confirm_rounds)
        arm = self._turns.at_boundary()
        if arm is not None:
            return self._run(arm)
        if not self._turns.done:
            return None
        self.verdict = decide(slowest_rank(self._turns.samples(), control), self._turns.steps)
        self._turns = None
        self._drift = DriftWatch(self.verdict.medians_s[self.verdict.keep], self.drift, self.drift_steps)
        return self._run(self.verdict.keep)

    def _run(self, arm: int) -> Optional[int]:
        if arm == self.arm:
            return None
        self.arm = arm
        return arm
