"""Choosing between configurations: the run's model predicts, real training steps confirm.

Every automatic choice commsched makes (planned buckets or fixed ones, DeAR or WFBP, sparse or
dense exchanges, several streams or one, DeFT's plan or an exact schedule) is a claim that one
configuration runs faster than the simple default. Two sources speak to it:

- the model: the step each arm allows for the compute and communication the profiler measured
  (a bound or a replayed timeline). It is steady, but leaves out what a real step holds (data
  loading, callbacks, the optimizer, contention);
- the measurement: the arms take turns on real steps (A B A B ...), the first step after each
  switch left out (it pays for the switch), every step timed as the slowest rank measured it, so
  that all ranks reach the same verdict. It is real, but noisy: a machine's steps vary by 5-10%,
  and a drift (another job, a throttled core) would read as a difference if the arms ran one
  after the other.

So the arm the model favours (the default, the simpler arm, when the model predicts no clear
gain or has nothing to say) is kept unless the measurement contradicts it beyond the noise of
those very steps: two standard errors of the difference of the medians, from the steps' own
spread. Where the two agree the choice is quick (two rounds of turns); a measurement that overrules
the model needs all the rounds asked for; where it leans the other way within the noise, more
turns are taken until the difference is resolved or a budget is spent.
A choice is checked again later on many more steps (`RECHECK_AFTER`), so that an early verdict
on a noisy moment is corrected at a cost far below 1% of the run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

MIN_MARGIN = 0.01
"""A measurement overrules the model only by at least 1%, even on a perfectly quiet machine."""
MODEL_MARGIN = 0.03
"""The model favours a candidate only when it predicts it at least 3% faster than the default:
less is inside what the model leaves out, and the default (the simpler arm) is kept."""
MEDIAN_EFFICIENCY = 1.2533
"""Standard error of a median over that of a mean, for normal noise (sqrt(pi / 2))."""
QUICK_ROUNDS = 2
"""Rounds after which steps that agree with the model end a comparison (one round more each time, after)."""
BUDGET_FACTOR = 2
"""The rounds a comparison may grow to, as a multiple of its first rounds (unless told otherwise)."""
RECHECK_AFTER = ((500, 3), (5000, 6))
"""(iterations after the first verdict, how many times longer each turn is) of the later checks:
at 500 iterations with 3 x 3 steps a turn, the other arm runs about 30 steps (0.6% of the run if it
is 10% slower); at 5,000 with 6 x 3, about 57 (0.1%)."""


@dataclass(frozen=True)
class Verdict:
    """What the model and the measured steps say: `keep` is the index of the arm kept (0: the default)."""

    keep: int
    medians_s: list[float]
    margin: float
    """The relative difference the measurement needed to overrule the model (from the spread of the steps, at least
    `MIN_MARGIN`)."""
    steps: int
    """Training steps the comparison took, switches included."""
    predicted_s: Optional[list[float]] = None
    """The model's step for each arm (None: no model for this choice)."""
    favoured: int = 0
    """The arm the model favours (0 when it predicts no clear gain, or has nothing to say)."""
    resolved: bool = True
    """False when the measured fastest arm is not the favoured one but not beyond the noise: more turns would tell."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> "Verdict":
        return cls(**saved)

    @property
    def gain(self) -> float:
        """How much faster the kept arm ran than the default (1.0 when the default is kept)."""
        return self.medians_s[0] / self.medians_s[self.keep]

    def describe(self, names: Sequence[str]) -> str:
        """Predicted, measured and chosen, in one sentence: e.g. "predicted dear 411 ms/step and
        wfbp 486; measured dear 420 and wfbp 471 (noise margin 4%, 64 steps): dear kept"."""
        order = sorted(range(len(names)), key=lambda arm: arm != self.keep)
        if self.predicted_s is not None:
            predicted = (
                "predicted "
                + " and ".join(
                    f"{names[a]} {self.predicted_s[a] * 1e3:.1f}{' ms/step' if i == 0 else ''}"
                    for i, a in enumerate(order)
                )
                + "; "
            )
        else:
            predicted = "no model; "
        measured = "measured " + " and ".join(
            f"{names[a]} {self.medians_s[a] * 1e3:.1f}{' ms/step' if i == 0 else ''}" for i, a in enumerate(order)
        )
        model = self.predicted_s
        clear = model is not None and any(
            model[self.favoured] < model[a] * (1.0 - MODEL_MARGIN) for a in range(len(model)) if a != self.favoured
        )
        if self.keep != self.favoured:
            why = (
                f"the measurement overruled the model's {names[self.favoured]}"
                if clear
                else f"measured faster than {names[self.favoured]} beyond the noise"
                + (" (the model saw no clear difference)" if model is not None else "")
            )
        elif not self.resolved:
            why = "within the noise after the budget of turns: " + ("the model's choice" if clear else "the default")
        elif clear:
            why = "the model's choice, confirmed"
        else:
            why = "the default, confirmed" if self.keep == 0 else "confirmed"
        return (
            f"{predicted}{measured} (noise margin {self.margin:.0%}, {self.steps} steps): "
            f"{names[self.keep]} kept, {why}"
        )


def relative_spread(samples: Sequence[Sequence[float]]) -> float:
    """The steps' coefficient of variation, pooled over the arms, from the median absolute deviation
    (one slow step, a garbage collection, does not inflate it as it would a standard deviation)."""
    deviations = [abs(t / statistics.median(arm) - 1.0) for arm in samples if arm for t in arm]
    return 1.4826 * statistics.median(deviations) if deviations else 0.0


def favoured(predicted: Optional[Sequence[float]], min_gain: float = MODEL_MARGIN) -> int:
    """The arm the model favours: its fastest, if predicted faster than the default by more than `min_gain`, else the
    default."""
    if predicted is None or len(predicted) < 2 or not all(math.isfinite(p) and p > 0 for p in predicted):
        return 0
    best = min(range(len(predicted)), key=predicted.__getitem__)
    return best if predicted[best] < predicted[0] * (1.0 - min_gain) else 0


def verdict_from_samples(
    samples: Sequence[Sequence[float]],
    steps: int = 0,
    predicted: Optional[Sequence[float]] = None,
    min_margin: float = MIN_MARGIN,
) -> Verdict:
    """Arm 0 is the default. The arm the model favours (`favoured`) is kept unless another arm's median
    step is faster than its own by more than `margin`: two standard errors of the relative difference
    of two medians of n steps each (2 x 1.2533 x sqrt(2 / n) x the steps' relative spread)."""
    if len(samples) < 2 or any(not arm for arm in samples):
        raise ValueError("every arm needs at least one timed step")
    if predicted is not None and len(predicted) != len(samples):
        raise ValueError("one prediction per arm")
    medians = [statistics.median(arm) for arm in samples]
    n = min(len(arm) for arm in samples)
    margin = max(min_margin, 2.0 * MEDIAN_EFFICIENCY * math.sqrt(2.0 / n) * relative_spread(samples))
    prior = favoured(predicted)
    best = min(range(len(samples)), key=lambda arm: (medians[arm], arm != prior))
    overruled = best != prior and medians[best] < medians[prior] * (1.0 - margin)
    return Verdict(
        best if overruled else prior,
        medians,
        margin,
        steps,
        list(predicted) if predicted is not None else None,
        prior,
        resolved=overruled or best == prior,
    )


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

    def add_rounds(self, rounds: int) -> None:
        """After the last turn: `rounds` more turns of each arm; the next `at_boundary` starts the first."""
        if not self.done:
            raise RuntimeError("rounds are added once the turns are done")
        self._order += [arm for _ in range(rounds) for arm in range(self.arms)]
        self.rounds += rounds
        self._turn -= 1
        self._in_turn = self.steps_per_turn + 1

    def samples(self) -> list[list[float]]:
        return [list(arm) for arm in self._seconds]


def slowest_rank_steps(samples: list[list[float]], control: Any) -> list[list[float]]:
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


class Comparison:
    """The arms' turns, judged after each round from `QUICK_ROUNDS` on (a collective on the control
    link, every rank at the same iteration): steps that agree with the model end it there; a
    measurement that would overrule the model needs `rounds` rounds; steps that lean against the
    model within their noise get more rounds, up to `max_rounds` (`BUDGET_FACTOR` x `rounds` unless
    given). Every rank calls `at_boundary` at every iteration start, then `conclude` once `done`:
    None means another round was added."""

    def __init__(
        self,
        arms: int,
        steps_per_turn: int,
        rounds: int,
        predicted: Optional[Sequence[float]] = None,
        max_rounds: Optional[int] = None,
    ) -> None:
        self.rounds = rounds
        self.turns = Turns(arms=arms, steps_per_turn=steps_per_turn, rounds=min(rounds, QUICK_ROUNDS))
        self.predicted = list(predicted) if predicted is not None else None
        self.max_rounds = max(rounds, rounds * BUDGET_FACTOR if max_rounds is None else max_rounds)

    @property
    def done(self) -> bool:
        return self.turns.done

    def at_boundary(self, now: Optional[float] = None) -> Optional[int]:
        return self.turns.at_boundary(now)

    def conclude(self, control: Any) -> Optional[Verdict]:
        arms = self.turns.arms
        predicted = self.predicted if self.predicted is not None else [-1.0] * arms  # -1: no prediction on this rank
        # each rank's prediction comes from its own profile: every rank judges the slowest rank's, as it does the steps
        combined = slowest_rank_steps([*self.turns.samples(), predicted], control)
        samples, agreed = combined[:arms], combined[arms]
        verdict = verdict_from_samples(samples, self.turns.steps, agreed if min(agreed) > 0 else None)
        done = self.turns.rounds
        agrees = verdict.resolved and verdict.keep == verdict.favoured
        if done >= self.max_rounds or agrees or (verdict.resolved and done >= self.rounds):
            return verdict
        self.turns.add_rounds(1)
        return None


class DriftCheck:
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


class Rechecks:
    """When a kept choice is compared again (`RECHECK_AFTER`): `due()` is called at every iteration
    start after a verdict and returns how many times longer the check's turns are, or 0."""

    def __init__(self, schedule: Sequence[tuple[int, int]] = RECHECK_AFTER) -> None:
        self.schedule = list(schedule)
        self.iterations = 0
        self.done = 0
        """Checks made so far."""

    def state_dict(self, checking: bool = False) -> dict[str, int]:
        """`checking`: a check is under way, and is made again after a resume (its turns are not saved)."""
        return {"iterations": self.iterations, "done": self.done - (1 if checking and self.done else 0)}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.iterations, self.done = int(saved.get("iterations", 0)), int(saved.get("done", 0))

    def due(self) -> int:
        self.iterations += 1
        if self.done < len(self.schedule) and self.iterations >= self.schedule[self.done][0]:
            self.done += 1
            return self.schedule[self.done - 1][1]
        return 0


class MeasuredChoice:
    """The default (arm 0) or a candidate (arm 1), chosen after `warmup` iterations from the model's
    prediction (`predict`, read when the comparison starts) and real steps, checked again later in
    the run (`RECHECK_AFTER`) and when the steps drift. Every rank calls `at_boundary` at every
    iteration start and runs the arm it returns; `verdict` holds the last choice's measurements."""

    def __init__(
        self,
        confirm_steps: int,
        confirm_rounds: int,
        drift: float,
        drift_steps: int,
        warmup: int = 5,
        predict: Optional[Callable[[], Optional[Sequence[float]]]] = None,
        rechecks: Sequence[tuple[int, int]] = RECHECK_AFTER,
        max_rounds: Optional[int] = None,
    ) -> None:
        self.confirm_steps, self.confirm_rounds, self.drift, self.drift_steps, self.warmup = (
            confirm_steps,
            confirm_rounds,
            drift,
            drift_steps,
            warmup,
        )
        self.max_rounds = max_rounds
        self.predict = predict
        self.arm = 1  # the candidate runs until it is measured
        self.verdict: Optional[Verdict] = None
        self.reopened = 0
        """Choices made again after a drift."""
        self.rechecks = Rechecks(rechecks)
        self._warming = 0
        self._comparison: Optional[Comparison] = None
        self._drift: Optional[DriftCheck] = None

    @property
    def deciding(self) -> bool:
        return self.verdict is None

    def at_boundary(self, control: Any) -> Optional[int]:
        """The arm to run from this iteration on (None: the one running). Reads `reopened` to tell a
        drift's new comparison from the first."""
        if self.verdict is not None and self._comparison is None:
            factor = self.rechecks.due()
            if factor:
                self._start(factor)
            elif self._drift is not None and self._drift.at_boundary(control):
                self.verdict, self._drift, self._warming = None, None, self.warmup
                self.reopened += 1
            else:
                return None
        if self.verdict is None and self._warming < self.warmup:
            self._warming += 1
            return None
        if self._comparison is None:
            self._start(1)
        assert self._comparison is not None
        arm = self._comparison.at_boundary()
        if arm is not None:
            return self._run(arm)
        if not self._comparison.done:
            return None
        verdict = self._comparison.conclude(control)
        if verdict is None:  # more turns: the first of them starts now
            return self._run(self._comparison.at_boundary())
        self.verdict, self._comparison = verdict, None
        self._drift = DriftCheck(verdict.medians_s[verdict.keep], self.drift, self.drift_steps)
        return self._run(verdict.keep)

    def state_dict(self) -> dict[str, Any]:
        """Communication state, equal on every rank (verdicts are reached together): the verdict, the
        iterations its later checks count, the drifts that re-opened it. Turns under way are not kept:
        a resumed run takes them again (a first choice from its warm-up, a later check at once)."""
        return {
            "verdict": self.verdict.to_json() if self.verdict is not None else None,
            "reopened": self.reopened,
            "rechecks": self.rechecks.state_dict(checking=self._comparison is not None and self.verdict is not None),
        }

    def load_state_dict(self, saved: Optional[dict[str, Any]]) -> None:
        """A checkpoint's choice, kept as it was decided (its arm runs from the first step, its later
        checks come when they were due). Only a choice that has not run yet takes it: a bucket
        rebuild hands a running choice back what it just gave."""
        if not saved or self.verdict is not None or self._comparison is not None or self._warming or self.reopened:
            return
        self.reopened = int(saved.get("reopened", 0))
        self.rechecks.load_state_dict(saved.get("rechecks", {}))
        if saved.get("verdict") is not None:
            self.verdict = Verdict.from_json(saved["verdict"])
            self.arm = self.verdict.keep
            self._drift = DriftCheck(self.verdict.medians_s[self.verdict.keep], self.drift, self.drift_steps)

    def _start(self, factor: int) -> None:
        predicted = self.predict() if self.predict is not None else None
        self._comparison = Comparison(2, self.confirm_steps * factor, self.confirm_rounds, predicted, self.max_rounds)

    def _run(self, arm: Optional[int]) -> Optional[int]:
        if arm is None or arm == self.arm:
            return None
        self.arm = arm
        return arm
