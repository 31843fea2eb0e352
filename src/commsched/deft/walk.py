"""The Gaussian walk with rebound (Yin et al., KDD 2017) that DeFT's Preserver uses ([DeFT] §IV-C).

The training loss s moves by s_{t+1} = S* + |s_t - S* - eta * ds_t| with ds_t ~ N(mu_t, sigma_t^2 / B):
a step of batch B makes progress mu_t (the squared norm of the mean gradient) with noise sigma_t^2 / B
(sigma_t^2: per-sample variance of the gradient along its mean direction). Its expectation has a
closed form (`expected_next`; the paper prints eta*ds_t in the first factor where eta*mu_t is meant).
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
    """eta: the learning rate."""
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


def gradient_statistics(projections: Sequence[Sequence[float]], local_batch: int) -> tuple[float, float]:
    """(mu, sigma) from probe steps: per probe, each rank's batch-mean gradient projected on the
    unit direction of the mean gradient (x_r = <g_r, g> / |g|). The mean of x_r is |g|, so
    mu = |g|^2; the unbiased variance of x_r across ranks is the variance of a `local_batch`-sample
    mean, so the per-sample variance is `local_batch` times it. Both are pooled over the probes."""
    mus, variances = [], []
    for xs in projections:
        n = len(xs)
        mean = sum(xs) / n
        mus.append(mean * mean)
        if n > 1:
            variances.append(local_batch * sum((x - mean) ** 2 for x in xs) / (n - 1))
    mu = sum(mus) / len(mus) if mus else 0.0
    sigma = math.sqrt(sum(variances) / len(variances)) if variances else 0.0
    return mu, sigma
