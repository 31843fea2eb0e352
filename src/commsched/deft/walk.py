"""The Gaussian walk with rebound (Yin et al., KDD 2017) that DeFT's Preserver uses ([DeFT] §IV-C).

The training loss s moves by s_{t+1} = S* + |s_t - S* - eta * ds_t| with ds_t ~ N(mu_t, sigma_t^2 / B):
a step of batch B makes progress mu_t (the squared norm of the mean gradient) with noise sigma_t^2 / B
(sigma_t^2: per-sample variance of that progress, <grad L, g_i>), eta the optimizer's effective step. Its expectation
has a closed form (`expected_next`; the paper prints eta*ds_t in the first factor where eta*mu_t is meant).
A sequence of steps is followed on the expected value, step by step, as the paper does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scipy.stats import norm


@dataclass(frozen=True)
class WalkState:
    """What the walk starts from, measured in the run."""

    loss: float
    """s_t: the training loss now."""
    lr: float
    """eta: the optimizer's effective step per unit gradient (`effective_step`, `measured_step`)."""
    mu: float
    """mu_t: squared norm of the mean gradient."""
    sigma: float
    """sigma_t: per-sample standard deviation of the gradient along its mean direction."""
    batch: int
    """B: samples in one synchronous step (all ranks)."""
    optimum: float = 0.0
    """S*: the lowest loss the walk can reach."""


def expected_next(s: float, optimum: float, lr: float, mu: float, sigma: float, batch: float) -> float:
    """E(s_{t+1}) for one step of batch `batch` from loss `s` (closed form of E|X| + S*, X ~ N(m, sd^2))."""
    m = s - optimum - lr * mu
    sd = lr * sigma / math.sqrt(batch)
    if sd <= 0:
        return abs(m) + optimum
    a = m / sd
    return float(m * (norm.cdf(a) - norm.cdf(-a)) + sd * math.sqrt(2 / math.pi) * math.exp(-a * a / 2) + optimum)


def expected_after(state: WalkState, batch_multiples: Sequence[int]) -> float:
    """The expected loss after one step per entry, each of `k * state.batch` samples."""
    s = state.loss
    for k in batch_multiples:
        s = expected_next(s, state.optimum, state.lr, state.mu, state.sigma, k * state.batch)
    return s


def plan_ratio(state: WalkState, k: Sequence[int]) -> float:
    """E(s) after the plan's steps (batches k_i * B, sum(k) iterations) over E(s) after as many
    iterations of synchronous steps of batch B: 1 means the plan converges as the baseline does."""
    baseline = expected_after(state, [1] * sum(k))
    return expected_after(state, k) / baseline if baseline > 0 else 1.0


def gradient_statistics(
    projections: Sequence[Sequence[float]], squared_norms: Sequence[Sequence[float]], local_batch: int
) -> tuple[float, float]:
    """(mu, sigma) of the walk from probe steps, in the walk's units (a step's progress per unit
    learning rate is <grad L, g_batch>, with mean |grad L|^2).

    Per probe and rank r: x_r, this rank's batch-mean gradient projected on the unit direction of
    the mean over ranks (so mean_r x_r = |g_bar|), and n_r = |g_r|^2. With R ranks of b samples:
    - |g_bar|^2 overestimates |grad L|^2 by tr(Sigma)/(bR) (the noise of the mean); tr(Sigma)/b is
      estimated without bias by R/(R-1) (mean_r n_r - |g_bar|^2), so
      mu = |g_bar|^2 - (mean_r n_r - |g_bar|^2) / (R - 1);
    - the per-sample variance along the mean direction is v = b Var_r(x_r) (unbiased across ranks);
      a sample's progress <grad L, g_i> = |grad L| x_i then has variance sigma^2 = mu v.
    Both are pooled over the probes; mu is floored at 0 (a gradient lost in its own noise)."""
    mus, variances = [], []
    for xs, ns in zip(projections, squared_norms):
        ranks = len(xs)
        if ranks < 2:
            continue
        mean = sum(xs) / ranks
        noise_of_mean = (sum(ns) / ranks - mean * mean) / (ranks - 1)
        mus.append(mean * mean - noise_of_mean)
        variances.append(local_batch * sum((x - mean) ** 2 for x in xs) / (ranks - 1))
    if not mus:
        return 0.0, 0.0
    mu = max(0.0, sum(mus) / len(mus))
    return mu, math.sqrt(mu * sum(variances) / len(variances))


def effective_step(optimizer: object) -> float:
    """eta of the walk: the step the optimizer takes per unit gradient, read from it. Plain SGD: lr;
    with momentum beta (heavy ball or Nesterov, dampening d): lr (1 - d) / (1 - beta), its steady
    state. Adaptive optimizers are measured instead (`measured_step`)."""
    group = optimizer.param_groups[0]  # type: ignore[attr-defined]
    beta = float(group.get("momentum", 0.0) or 0.0)
    dampening = float(group.get("dampening", 0.0) or 0.0)
    return float(group["lr"]) * (1.0 - dampening) / (1.0 - beta) if beta < 1 else float(group["lr"])


def measured_step(displacement_dot_gradient: float, gradient_norm2: float) -> float:
    """eta of an optimizer whose step is not a multiple of the gradient (Adam and kin): the step it
    actually took, projected on the gradient it took it from: -<delta theta, g> / |g|^2."""
    return max(0.0, -displacement_dot_gradient / gradient_norm2) if gradient_norm2 > 0 else 0.0
