"""The choice between DeFT's plan and an exact schedule, confirmed on real steps.

`predict.choose_schedule` compares models of one steady iteration built from stage and collective
times measured in isolation. A real step also holds what the models leave out: data loading, the
user's callbacks, the optimizer, contention between compute and communication threads. So the
predicted choice and its runner-up each run a few real steps, every rank times them from iteration
start to iteration start, the ranks agree on the slowest rank's median (the step is as slow as its
slowest rank), and the runner-up replaces the prediction only when it was measured clearly faster.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from commsched.deft.predict import DEAR_MARGIN, Choice
from commsched.device_time import synchronize
from commsched.links import Link
from commsched.say import say


class Confirmation:
    """Runs the runner-up first and the prediction last, so that a confirmed prediction needs no
    further switch. Every rank calls `at_boundary` at the same iteration starts."""

    def __init__(self, predicted: Choice, steps: int, control: Link, device: torch.device) -> None:
        self.predicted = predicted
        self.candidates = [predicted.runner_up(), predicted]
        self.steps = steps
        self._control = control
        self._device = device
        self._seconds: list[list[float]] = [[] for _ in self.candidates]
        self._index = 0
        self._stamp: Optional[float] = None

    @property
    def running(self) -> Choice:
        """The candidate that runs the iterations now."""
        return self.candidates[self._index]

    def at_boundary(self) -> Optional[Choice]:
        """Times the iteration that just ended; the confirmed choice once every candidate ran
        `steps` timed iterations (each candidate's first iteration, its switch, is left out)."""
        synchronize(self._device)
        now = time.perf_counter()
        if self._stamp is not None:
            self._seconds[self._index].append(now - self._stamp)
        self._stamp = now
        if len(self._seconds[self._index]) <= self.steps:
            return None
        self._index += 1
        self._stamp = None if self._index == len(self.candidates) else now
        return self._agree() if self._index == len(self.candidates) else None

    def _agree(self) -> Choice:
        mine = [statistics.median(seconds[1:]) for seconds in self._seconds]
        slowest = self._control.tensor(mine, torch.float64)
        self._control.all_reduce(slowest, "deft-confirm", op=torch.distributed.ReduceOp.MAX).wait()
        runner_up_s, predicted_s = slowest.tolist()
        measured = {self.candidates[0].runs: runner_up_s * 1e3, self.predicted.runs: predicted_s * 1e3}
        keep, other = self.candidates[::-1] if runner_up_s >= predicted_s * (1.0 - DEAR_MARGIN) else self.candidates
        chosen = Choice(keep.runs, keep.dear_links, self.predicted.predicted, (other.runs, other.dear_links), measured)
        verdict = "confirmed" if keep is self.predicted else f"overruled: {keep.runs} runs the iterations"
        say(f"commsched deft: measured {runner_up_s * 1e3:.1f} ms/step for {self.candidates[0].runs} and "
            f"{predicted_s * 1e3:.1f} ms/step for {self.predicted.runs} (the prediction): {verdict}")
        return chosen
