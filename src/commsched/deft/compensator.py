"""What a late generation gets, as DeFT's schedule runs it: the compensation resolved for the user's
optimizer ("auto" until its first step shows which optimizer that is), the weight prediction it may
hold, and the user's step taken through it. Kept apart from the schedule, which only says when a
generation steps and how late it is."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn
from torch.optim import Optimizer

from commsched.deft.spike_compensation import measured_staleness, resolve_compensation, spike_step
from commsched.deft.weight_prediction import WeightPrediction


class Compensator:
    def __init__(self, requested: str, params: list[nn.Parameter], names: list[str]) -> None:
        self.name = requested
        """The compensation that runs ("auto" until the optimizer's first step resolves it)."""
        self._params, self._names = params, names
        self.prediction: Optional[WeightPrediction] = self._predicting() if requested.endswith("predict") else None

    def _predicting(self) -> WeightPrediction:
        return WeightPrediction(self._params, self._names)

    def _resolve(self, optimizer: Optimizer) -> None:
        """ "auto" becomes the compensation that recovered the most for this optimizer (`chosen_for`)."""
        if self.name != "auto":
            return
        self.name = resolve_compensation("auto", optimizer)
        if not self.name.endswith("predict"):
            self.prediction = None
        elif self.prediction is None:
            self.prediction = self._predicting()

    def step(self, optimizer: Optimizer, real_step: Callable[[], Any], late: int, may_predict: bool = True) -> None:
        """The user's step on gradients `late` optimizer steps old, compensated. `may_predict` False (a plan
        that delays nothing): no later forward is predicted, so the weights before the step are not kept
        (a copy of every parameter a step, and its memory, saved)."""
        self._resolve(optimizer)
        if self.prediction is not None and may_predict:
            self.prediction.before_step()
        elif self.prediction is not None:
            self.prediction.forget()
        if self.name.startswith("spike"):
            spike_step(optimizer, real_step, late)
        else:
            real_step()

    def measured_staleness(self, optimizer: Optional[Optimizer]) -> int:
        """How late a generation may step and keep accuracy, as measured, with this compensation."""
        return measured_staleness(self.name, optimizer) if optimizer is not None else 0

    def predict(self, steps: int) -> None:
        if self.prediction is not None:
            self.prediction.predict(steps)

    def restore(self) -> None:
        if self.prediction is not None:
            self.prediction.restore()

    def forget(self) -> None:
        """An exact schedule takes the steps: the last update seen here is no longer the last one."""
        if self.prediction is not None:
            self.prediction.forget()

    def state(self) -> dict[str, Any]:
        return self.prediction.state() if self.prediction is not None else {}

    def load(self, saved: dict[str, Any]) -> None:
        if self.prediction is None and self.name == "auto" and saved:
            self.prediction = self._predicting()  # "auto" chose prediction in the run saved
        if self.prediction is not None:
            self.prediction.load(saved)
