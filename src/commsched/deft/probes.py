"""What the Preserver's walk needs from the run, measured on fully synchronised steps: the gradient's
mean and its spread across ranks (`walk.gradient_statistics`), the loss, learning rate and batch."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from commsched.deft.walk import gradient_statistics
from commsched.links import Link


class GradientProbes:
    def __init__(self, control: Link, world_size: int, rank: int) -> None:
        self._control = control
        self._world_size = world_size
        self._rank = rank
        self.projections: list[list[float]] = []

    def record(self, local: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor]) -> None:
        """One probe: this rank's gradient (`local`, the 1/P-scaled bucket buffers) projected on the unit
        direction of the averaged one, gathered from every rank (a collective on the control link)."""
        dot = torch.zeros((), dtype=torch.float64)
        norm2 = torch.zeros((), dtype=torch.float64)
        for mine, mean in zip(local, averaged):
            mean = mean.double().cpu()
            dot += (mine.double().cpu() * self._world_size * mean).sum()
            norm2 += (mean * mean).sum()
        x = (dot / norm2.sqrt()).item() if norm2 > 0 else 0.0
        everyone = self._control.tensor([0.0] * self._world_size, torch.float64)
        everyone[self._rank] = x
        self._control.all_reduce(everyone, "deft-probe").wait()
        self.projections.append(everyone.tolist())

    def walk_statistics(self, preserver: Any) -> dict[str, float]:
        """mu, sigma from the probes; the loss averaged over ranks; lr and batch as the Preserver saw them.
        A collective on the control link (every rank calls it)."""
        local_batch = preserver.local_batch if preserver is not None and preserver.local_batch else 1
        mu, sigma = gradient_statistics(self.projections, local_batch)
        loss = preserver.last_loss if preserver is not None and preserver.last_loss is not None else 0.0
        agreed = self._control.tensor([loss], torch.float64)
        self._control.all_reduce(agreed, "deft-loss").wait()
        return {"mu": mu, "sigma": sigma, "loss": agreed.item() / self._world_size,
                "batch": local_batch * self._world_size, "lr": preserver.last_lr if preserver is not None else 0.0}
