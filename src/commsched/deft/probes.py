"""What the Preserver's walk needs from the run, measured on fully synchronised steps: the gradient's
mean and its spread across ranks (`walk.gradient_statistics`), the optimizer's effective step
(`walk.effective_step` for SGD, the measured step for others), the loss and the batch."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional, Sequence

import torch

from commsched.comm.links import Link
from commsched.deft.stability import Stepper
from commsched.deft.walk import effective_step, gradient_statistics, measured_step


class GradientProbes:
    def __init__(self, control: Link, world_size: int, rank: int) -> None:
        self._control = control
        self._world_size = world_size
        self._rank = rank
        self.projections: list[list[float]] = []
        self.squared_norms: list[list[float]] = []
        self.steps: list[float] = []
        """The measured effective step of each probe (optimizers other than SGD)."""
        self.optimizer: Optional[torch.optim.Optimizer] = None

    def clear(self) -> None:
        """Forget the probes taken (a decision used them, or measuring starts again)."""
        self.projections.clear()
        self.squared_norms.clear()
        self.steps.clear()

    def record(self, local: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor]) -> None:
        """One probe: this rank's gradient (`local`, the 1/P-scaled bucket buffers) projected on the unit
        direction of the averaged one, and its squared norm, gathered from every rank (a collective on
        the control link)."""
        dot = torch.zeros((), dtype=torch.float64)
        norm2 = torch.zeros((), dtype=torch.float64)
        mine2 = torch.zeros((), dtype=torch.float64)
        for mine, mean in zip(local, averaged):
            mean = mean.double().cpu()
            mine = mine.double().cpu() * self._world_size
            dot += (mine * mean).sum()
            norm2 += (mean * mean).sum()
            mine2 += (mine * mine).sum()
        x = (dot / norm2.sqrt()).item() if norm2 > 0 else 0.0
        everyone = self._control.tensor([0.0] * (2 * self._world_size), torch.float64)
        everyone[self._rank] = x
        everyone[self._world_size + self._rank] = mine2.item()
        self._control.all_reduce(everyone, "deft-probe").wait()
        gathered = everyone.tolist()
        self.projections.append(gathered[: self._world_size])
        self.squared_norms.append(gathered[self._world_size :])

    def step(self, optimizer: torch.optim.Optimizer, real_step: Callable[[], Any]) -> None:
        """Takes a probe step; for an optimizer whose step is not read from its settings (not SGD),
        measures the step it took along the (averaged) gradient. Identical on every rank."""
        self.optimizer = optimizer
        if isinstance(optimizer, torch.optim.SGD):
            real_step()
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        before = [p.detach().clone() for p in params]
        grads = [p.grad.detach().clone() for p in params]
        real_step()
        moved = sum(float(((p.detach() - b).double() * g.double()).sum()) for p, b, g in zip(params, before, grads))
        self.steps.append(measured_step(moved, sum(float((g.double() ** 2).sum()) for g in grads)))

    def eta(self, fallback: float) -> float:
        """The effective step: read from SGD, else the median measured one (the Preserver's lr before any)."""
        if isinstance(self.optimizer, torch.optim.SGD):
            return effective_step(self.optimizer)
        return statistics.median(self.steps) if self.steps else fallback

    def walk_statistics(self, preserver: Any) -> dict[str, Any]:
        """mu, sigma from the probes; the loss and the top curvature averaged over ranks (the
        curvature None unless every rank measured one); lr and batch as the Preserver saw them; the
        optimizer as the stability model sees it. A collective on the control link (every rank calls it)."""
        local_batch = preserver.local_batch if preserver is not None and preserver.local_batch else 1
        mu, sigma = gradient_statistics(self.projections, self.squared_norms, local_batch)
        loss = preserver.last_loss if preserver is not None and preserver.last_loss is not None else 0.0
        measured = [c for c in (preserver.curvatures if preserver is not None else []) if c is not None]
        whole = bool(measured) and len(measured) == len(preserver.curvatures)
        agreed = self._control.tensor([loss, statistics.mean(measured) if whole else 0.0, float(whole)], torch.float64)
        self._control.all_reduce(agreed, "deft-loss").wait()
        total_loss, total_curvature, measuring_ranks = agreed.tolist()
        if preserver is not None:
            preserver.curvatures.clear()
        eta = self.eta(preserver.last_lr if preserver is not None else 0.0)
        return {
            "mu": mu,
            "sigma": sigma,
            "loss": total_loss / self._world_size,
            "batch": local_batch * self._world_size,
            "lr": eta,
            "curvature": total_curvature / self._world_size if measuring_ranks == self._world_size else None,
            "stepper": Stepper.of(self.optimizer, None if isinstance(self.optimizer, torch.optim.SGD) else eta)
            if self.optimizer is not None
            else None,
        }
