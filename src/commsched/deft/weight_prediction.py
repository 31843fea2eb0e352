"""Linear weight prediction for delayed generations (after Kosson et al., Pipelined Backpropagation at
Scale, 2021).

A gradient applied D optimizer steps after its forward was taken at weights D updates old. Linear
weight prediction runs that forward (and its backward) on the weights extrapolated D updates along the
last one, w + D (w - w_before_last_step), so that the gradient is taken about where it will be applied;
the step itself updates the weights as they are. It holds for any optimizer: only the weights the
forward sees change, between the start of the forward and the end of the backward (BatchNorm's running
statistics are updated by that forward, as any forward updates them).

Costs one copy of the trained parameters (the weights before the last step), kept in checkpoints so
that a resumed run predicts as the uninterrupted one, and a transient second copy during the forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class WeightPrediction:
    """The trained parameters' weights before the last step, and the swap to predicted weights and back.
    The swap replaces each parameter's data (the optimizer, the buckets and the hooks keep the same
    parameter objects); callbacks that run between the forward and the end of the backward see the
    predicted weights, every other one the weights themselves."""

    def __init__(self, params: list[nn.Parameter], names: list[str]) -> None:
        self.params, self.names = params, names
        self._before_last_step: Optional[list[torch.Tensor]] = None
        self._held: Optional[list[torch.Tensor]] = None

    @torch.no_grad()
    def before_step(self) -> None:
        """Called before every optimizer step: the weights the next update starts from."""
        if self._before_last_step is None:
            self._before_last_step = [p.detach().clone() for p in self.params]
        else:
            for kept, p in zip(self._before_last_step, self.params):
                kept.copy_(p)

    @torch.no_grad()
    def predict(self, steps: int) -> None:
        """Put the weights `steps` updates ahead (along the last update) until `restore`."""
        if steps <= 0 or self._before_last_step is None or self._held is not None:
            return
        self._held = [p.data for p in self.params]
        for p, now, before in zip(self.params, self._held, self._before_last_step):
            p.data = now + steps * (now - before)

    def restore(self) -> None:
        """The weights as they are (exactly: the predicted ones were a copy)."""
        if self._held is None:
            return
        for p, now in zip(self.params, self._held):
            p.data = now
        self._held = None

    def forget(self) -> None:
        """Steps are about to be taken by someone else (an exact schedule's turn): the next update seen
        here would not be the last one, so predict nothing until a step of ours is seen again."""
        self._before_last_step = None

    def state(self) -> dict[str, torch.Tensor]:
        if self._before_last_step is None:
            return {}
        return {name: kept.clone() for name, kept in zip(self.names, self._before_last_step)}

    def load(self, saved: dict[str, torch.Tensor]) -> None:
        if not saved:
            return
        self._before_last_step = [saved[name].to(p.device, p.dtype).clone() for name, p in zip(self.names, self.params)]
