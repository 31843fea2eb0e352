"""The top curvature of the user's loss: the largest eigenvalue of its Hessian with respect to the
trainable parameters, by power iteration on Hessian-vector products (Pearlmutter's double
backward: no Hessian is ever formed).

The Preserver measures it on DeFT's probe steps from the step's own loss, before Lightning's
backward of the same graph (so the step's gradients are untouched), and every rank's figure is
averaged (`probes.GradientProbes.walk_statistics`). One measurement costs about
2 x `iterations` backward passes and the memory of a double-backward graph, on probe steps only.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


class CurvatureUnavailable(RuntimeError):
    """The loss's graph has no second derivative (an op without double backward, e.g. a fused
    attention kernel): stale plans are then not accepted, since nothing shows they are stable."""


def top_curvature(
    loss: torch.Tensor, params: Sequence[torch.Tensor], iterations: int = 12, seed: int = 0, tolerance: float = 1e-3
) -> float:
    """The largest eigenvalue of d^2 loss / d params^2 (the most positive one: a negative curvature
    makes no oscillation for staleness to amplify). The graph of `loss` is kept for its backward."""
    params = [p for p in params if p.requires_grad]
    try:
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    except RuntimeError as error:
        raise CurvatureUnavailable(str(error)) from error
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    if any(not g.requires_grad for _, g in pairs):
        # an op whose backward is not differentiable (once_differentiable, a fused kernel) cut the graph:
        # reading that as zero curvature would make every stale plan look stable
        raise CurvatureUnavailable("a gradient of the loss has no graph of its own (an op without double backward)")
    if not pairs:
        return 0.0
    used, first = [p for p, _ in pairs], [g for _, g in pairs]

    def hessian_times(vector: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            products = torch.autograd.grad(first, used, grad_outputs=vector, retain_graph=True, allow_unused=True)
        except RuntimeError as error:
            raise CurvatureUnavailable(str(error)) from error
        return [torch.zeros_like(v) if h is None else h.detach() for h, v in zip(products, vector)]

    generator = torch.Generator().manual_seed(seed)
    start = [
        torch.randn(p.shape, generator=generator, dtype=torch.float32).to(device=p.device, dtype=p.dtype) for p in used
    ]
    top = _power_iteration(hessian_times, start, iterations, tolerance, shift=0.0)
    if top < 0:  # the most negative eigenvalue dominated: look again above it
        top = _power_iteration(hessian_times, start, iterations, tolerance, shift=-top)
    return max(0.0, top)


def _power_iteration(
    hessian_times, start: list[torch.Tensor], iterations: int, tolerance: float, shift: float
) -> float:
    """The dominant eigenvalue of H + shift I (its Rayleigh quotient at the last iterate)."""
    vector = _normalized(start)
    value = 0.0
    for _ in range(iterations):
        product = [h + shift * v for h, v in zip(hessian_times(vector), vector)]
        previous, value = value, float(sum((p.double() * v.double()).sum() for p, v in zip(product, vector)))
        vector = _normalized(product)
        if abs(value - previous) <= tolerance * abs(value):
            break
    return value - shift


def _normalized(vector: list[torch.Tensor]) -> list[torch.Tensor]:
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in vector))
    return [v / norm for v in vector] if norm > 0 else vector
