"""The choice between DeFT's plan and an exact schedule, confirmed on real steps.

`predict.choose_schedule` compares models of one steady iteration built from stage and collective
times measured in isolation. A real step also holds what the models leave out: data loading, the
user's callbacks, the optimizer, contention between compute and communication threads. So the
predicted choice and its runner-up take turns on real steps, and the simpler of the two (WFBP, then
DeAR, then the plan) is kept unless the other was measured faster by more than the noise of those
very steps (a fixed 2% margin let noise decide on a busy machine).
"""

from __future__ import annotations

from typing import Optional

import torch

from commsched.deft.predict import Choice
from commsched.comm.device_time import synchronize
from commsched.interleaved import Turns, decide, slowest_rank
from commsched.comm.links import Link
from commsched.say import say


SIMPLER = {"wfbp": 0, "dear": 1, "plan": 2}
"""The simpler schedule is the default a candidate must beat: WFBP (DDP's), then DeAR, then DeFT's own plan."""
ROUNDS = 2
"""Turns each of the two takes."""


class Confirmation:
    """The prediction and its runner-up take turns on real steps (`commsched.interleaved`: the first
    step after each switch untimed, the slowest rank's times, a margin from the steps' own spread);
    the simpler of the two is the default the other must beat by more than the noise. Every rank
    calls `at_boundary` at the same iteration starts."""

    def __init__(self, predicted: Choice, steps: int, control: Link, device: torch.device) -> None:
        self.predicted = predicted
        self.candidates = sorted([predicted.runner_up(), predicted], key=lambda c: SIMPLER[c.runs])
        self._control = control
        self._device = device
        self._turns = Turns(arms=2, steps_per_turn=steps, rounds=ROUNDS)
        self._index = 0

    @property
    def running(self) -> Choice:
        """The candidate that runs the iterations now."""
        return self.candidates[self._index]

    def at_boundary(self) -> Optional[Choice]:
        """The confirmed choice once both took their turns; None before."""
        synchronize(self._device)
        arm = self._turns.at_boundary()
        if arm is not None:
            self._index = arm
        if not self._turns.done:
            return None
        return self._agree()

    def _agree(self) -> Choice:
        verdict = decide(slowest_rank(self._turns.samples(), self._control), self._turns.steps)
        default, candidate = self.candidates
        measured = {default.runs: verdict.medians_s[0] * 1e3, candidate.runs: verdict.medians_s[1] * 1e3}
        keep, other = (candidate, default) if verdict.keep else (default, candidate)
        self._index = verdict.keep
        chosen = Choice(keep.runs, keep.dear_links, self.predicted.predicted, (other.runs, other.dear_links), measured)
        verdict_said = "confirmed" if keep.runs == self.predicted.runs else f"overruled: {keep.runs} runs the iterations"
        say(f"commsched deft: measured {measured[default.runs]:.1f} ms/step for {default.runs} and "
            f"{measured[candidate.runs]:.1f} ms/step for {candidate.runs} on alternating steps (noise margin "
            f"{verdict.margin:.0%}; {self.predicted.runs} was the prediction): {verdict_said}")
        return chosen
