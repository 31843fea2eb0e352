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
lr lambda < 1 - m, a band 38 times narrower at m = 0.9; with spike compensation and weight prediction
(`spike_compensation.py`) about 3.5 times wider than that. With `curvature_margin` > 0 the Preserver
measures the top curvature of the user's loss (`curvature.py`) and accepts a stale plan also where
that curvature, times the margin for the sharpening that training brings, stays inside the band of
the compensated optimizer. (BatchNorm networks sit far outside it, and still train to synchronous
accuracy one step late when compensated: the band is a sufficient condition, not a necessary one.)
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
            return cls(
                float(group["lr"]),
                float(group.get("momentum", 0.0) or 0.0),
                float(group.get("dampening", 0.0) or 0.0),
                bool(group.get("nesterov", False)),
                float(group.get("weight_decay", 0.0) or 0.0),
            )
        beta = float(group["betas"][0]) if "betas" in group else float(group.get("momentum", 0.0) or 0.0)
        step = measured_step if measured_step is not None else float(group["lr"])
        decay = float(group.get("weight_decay", 0.0) or 0.0) * float(group["lr"])
        return cls(step * (1.0 - beta), beta, 0.0, False, decay / max(step * (1.0 - beta), 1e-30))


def spectral_radius(stepper: Stepper, curvature: float, staleness: int, compensation: str = "none") -> float:
    """The largest |eigenvalue| of the recurrence above: below 1, the direction converges.

    With `compensation` (`commsched.deft.spike_compensation`), as DeFT applies it to a generation `staleness`
    steps late: "spike" scales the gradient entering the velocity by m^s and applies
    lr (1 - m^s) / (1 - m) of it at once; "predict" takes the gradient at x_{t-s} + s (x_{t-s} - x_{t-s-1})."""
    s = staleness
    spike = compensation.startswith("spike") and s > 0 and stepper.momentum > 0
    if spike and (stepper.nesterov or stepper.dampening):
        raise ValueError("spike compensation stands in for heavy-ball momentum (no Nesterov, no dampening)")
    size = s + 3  # x_t, ..., x_{t-s}, x_{t-s-1}, b_t
    at = np.zeros(size)  # where the gradient is taken
    at[s] = 1.0
    if compensation.endswith("predict") and s > 0:
        at[s] += s
        at[s + 1] -= s
    gradient = curvature * at
    gradient[0] += stepper.weight_decay
    kept, missed = (stepper.momentum**s, (1 - stepper.momentum**s) / (1 - stepper.momentum)) if spike else (1.0, 0.0)
    momentum = np.zeros(size)
    momentum[size - 1] = stepper.momentum
    new_momentum = momentum + (1.0 - stepper.dampening) * kept * gradient
    direction = gradient + stepper.momentum * new_momentum if stepper.nesterov else new_momentum + missed * gradient
    companion = np.zeros((size, size))
    companion[0] = -stepper.lr * direction
    companion[0, 0] += 1.0
    for i in range(1, s + 2):
        companion[i, i - 1] = 1.0
    companion[size - 1] = new_momentum
    return float(np.max(np.abs(np.linalg.eigvals(companion))))


def largest_stable_curvature(stepper: Stepper, staleness: int, compensation: str = "none", upper: float = 1e9) -> float:
    """The first curvature where the recurrence stops converging: scanned in steps of 2^(1/8) from
    1e-4 / lr, then bisected."""
    if stepper.lr <= 0:
        return float("inf")

    def stable(curvature: float) -> bool:
        return spectral_radius(stepper, curvature, staleness, compensation) < 1.0

    low, high = 0.0, 1e-4 / stepper.lr
    while stable(high):
        low, high = high, high * 2**0.125
        if high > upper:
            return float("inf")
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if stable(middle) else (low, middle)
    return low
