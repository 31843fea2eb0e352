"""When a stale update stays stable: the optimizer on a quadratic of curvature lambda, with its
gradient computed `staleness` iterations before the step that applies it.

The walk ([DeFT] §IV-C) models batch sizes, not late gradients: a plan whose generations step one
iteration late scores as harmless. What a late gradient does depends on the optimizer and the
model. On one eigen-direction of the loss (curvature lambda), SGD with momentum m, dampening d and
weight decay w (applied to the current weights, as torch's SGD does) taking a gradient from s
iterations back is the linear recurrence

    g_t     = lambda x_{t-s} + w x_t
    b_{t+1} = m b_t + (1 - d) g_t
    x_{t+1} = x_t - lr b_{t+1}                  (Nesterov: x_t - lr (g_t + m b_{t+1}))

It converges iff every eigenvalue of its companion matrix lies inside the unit circle. Closed
forms check it: s = 0 is stable while lr lambda < 2 (1 + m), s = 1 (w = 0) only while
lr lambda < 1 - m, a band 38 times narrower at m = 0.9. So the Preserver measures the top curvature
of the user's loss (`curvature.py`) and accepts a stale plan only while that curvature, times a
margin for the sharpening that training brings, stays inside the band.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class Stepper:
    """The optimizer as the recurrence sees it (one parameter group: the first)."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    """Applied to the current weights (torch's SGD, and AdamW's decoupled decay alike)."""

    @classmethod
    def of(cls, optimizer: Any, measured_step: Optional[float] = None) -> "Stepper":
        """SGD read from its settings. Other optimizers (Adam and kin) have no fixed step: with the
        step measured along the gradient (`walk.measured_step`, which includes the momentum's
        1/(1 - beta1)) they are modelled as heavy ball with momentum beta1 and lr step x (1 - beta1)."""
        group = optimizer.param_groups[0]
        if isinstance(optimizer, torch.optim.SGD):
            return cls(float(group["lr"]), float(group.get("momentum", 0.0) or 0.0), float(group.get("dampening", 0.0) or 0.0),
                       bool(group.get("nesterov", False)), float(group.get("weight_decay", 0.0) or 0.0))
        beta = float(group["betas"][0]) if "betas" in group else float(group.get("momentum", 0.0) or 0.0)
        step = measured_step if measured_step is not None else float(group["lr"])
        decay = float(group.get("weight_decay", 0.0) or 0.0) * float(group["lr"])
        return cls(step * (1.0 - beta), beta, 0.0, False, decay / max(step * (1.0 - beta), 1e-30))


def spectral_radius(stepper: Stepper, curvature: float, staleness: int) -> float:
    """The largest |eigenvalue| of the recurrence above: below 1, the direction converges."""
    s = staleness
    size = s + 2  # x_t, ..., x_{t-s}, b_t
    gradient = np.zeros(size)
    gradient[s] += curvature
    gradient[0] += stepper.weight_decay
    momentum = np.zeros(size)
    momentum[s + 1] = stepper.momentum
    new_momentum = momentum + (1.0 - stepper.dampening) * gradient
    direction = gradient + stepper.momentum * new_momentum if stepper.nesterov else new_momentum
    companion = np.zeros((size, size))
    companion[0] = -stepper.lr * direction
    companion[0, 0] += 1.0
    for i in range(1, s + 1):
        companion[i, i - 1] = 1.0
    companion[s + 1] = new_momentum
    return float(np.max(np.abs(np.linalg.eigvals(companion))))


def largest_stable_curvature(stepper: Stepper, staleness: int, upper: float = 1e9) -> float:
    """The curvature where the recurrence stops converging (bisection; the stable curvatures form
    one interval starting at 0)."""
    if stepper.lr <= 0:
        return float("inf")
    low, high = 0.0, 1.0 / stepper.lr
    while spectral_radius(stepper, high, staleness) < 1.0:
        low, high = high, high * 2.0
        if high > upper:
            return float("inf")
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if spectral_radius(stepper, middle, staleness) < 1.0 else (low, middle)
    return low
