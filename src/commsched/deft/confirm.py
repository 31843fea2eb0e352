"""The choice between DeFT's plan and an exact schedule, confirmed on real steps.

`iteration_model.choose_schedule` compares models of one steady iteration built from stage and collective
times measured in isolation. A real step also holds what the models leave out: data loading, the
user's callbacks, the optimizer, contention between compute and communication threads. So the
predicted choice and its runner-up take turns on real steps, and the one the model predicts faster
(the simpler of the two, WFBP, then DeAR, then the plan, when the predictions are within 3%) is
kept unless the other was measured faster by more than the noise of those very steps; steps that
lean the other way within the noise get more turns (`commsched.interleaved.Comparison`).
"""

from __future__ import annotations

from typing import Optional

import torch

from commsched.comm.device_time import synchronize
from commsched.comm.links import Link
from commsched.deft.iteration_model import SIMPLER, ScheduleChoice
from commsched.interleaved import Comparison
from commsched.say import say

ROUNDS = 2
"""Turns each of the two takes."""


class Confirmation:
    """The prediction and its runner-up take turns on real steps (`commsched.interleaved`: the first
    step after each switch untimed, the slowest rank's times, a margin from the steps' own spread);
    the simpler of the two is the default the other must beat by more than the noise. Every rank
    calls `at_boundary` at the same iteration starts."""

    def __init__(self, predicted: ScheduleChoice, steps: int, control: Link, device: torch.device) -> None:
        self.predicted = predicted
        self.candidates = sorted([predicted.runner_up(), predicted], key=lambda c: SIMPLER.index(c.runs))
        self._control = control
        self._device = device
        self._turns = Comparison(2, steps, ROUNDS, predicted_ms(predicted, [c.runs for c in self.candidates]))
        self._index = 0

    @property
    def running(self) -> ScheduleChoice:
        """The candidate that runs the iterations now."""
        return self.candidates[self._index]

    def at_boundary(self) -> Optional[ScheduleChoice]:
        """The confirmed choice once both took their turns; None before."""
        synchronize(self._device)
        arm = self._turns.at_boundary()
        if arm is not None:
            self._index = arm
        if not self._turns.done:
            return None
        return self._agree()

    def _agree(self) -> Optional[ScheduleChoice]:
        verdict = self._turns.conclude(self._control)
        if verdict is None:  # more turns: the first starts now
            arm = self._turns.at_boundary()
            if arm is not None:
                self._index = arm
            return None
        default, candidate = self.candidates
        measured = {default.runs: verdict.medians_s[0] * 1e3, candidate.runs: verdict.medians_s[1] * 1e3}
        keep, other = (candidate, default) if verdict.keep else (default, candidate)
        self._index = verdict.keep
        chosen = ScheduleChoice(
            keep.runs, keep.dear_links, self.predicted.predicted, (other.runs, other.dear_links), measured
        )
        verdict_said = (
            "confirmed" if keep.runs == self.predicted.runs else f"overruled: {keep.runs} runs the iterations"
        )
        say(
            f"commsched deft: {verdict.describe([default.runs, candidate.runs])}; {self.predicted.runs} was chosen "
            f"when solving: {verdict_said}"
        )
        return chosen


def predicted_ms(predicted: ScheduleChoice, runs: list[str]) -> Optional[list[float]]:
    """The model's step for each of `runs`, None when one was not predicted."""
    steps = [predicted.predicted.get(f"{run}_ms") for run in runs]
    return None if None in steps else [ms / 1e3 for ms in steps]
