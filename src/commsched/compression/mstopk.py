"""MSTopK ([cloud-topk] Algorithm 1): k elements of largest magnitude, approximately, without a sort.

A threshold is bisected between the mean and the maximum of |x| for `samplings` rounds, counting
the elements at or above it each time. The highest threshold that keeps at most k elements (th1,
k1 of them) and the lowest that keeps more than k (th2) bracket the exact k-th magnitude: every
element at or above th1 is taken, and k - k1 more are taken as a contiguous window, at an offset
drawn at random, of the elements in [th2, th1) in index order. Exactly k indices, each once.

Where the paper's text leaves a gap we close it: th1 starts above the maximum (so when no
threshold keeps k or fewer, e.g. more than k elements tie at the maximum, nothing is taken above
it rather than everything), th2 starts at 0 (every element below th1 is then a candidate for the
window), the search starts at 0 instead of the mean when at most k elements reach the mean,
k <= 0 selects nothing and k >= d everything.

Everything runs on x's device with fixed-size outputs (`torch.nonzero_static`): no host
synchronisation, so on CUDA a bucket's selection never stalls the stream it is enqueued on.
"""

from __future__ import annotations

from typing import Optional

import torch

SALT = 0x9E3779B1
"""Odd multiplier that spreads consecutive seeds over the window's offsets (a Weyl sequence)."""


def mstopk(
    x: torch.Tensor, k: int, samplings: int = 30, seed: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of `k` elements of the flat tensor `x` chosen by MSTopK; `indices` int64,
    ascending. `seed` picks the window's offset; None: a hash of `x`'s bits, so the offset changes
    from step to step with the gradients yet is the same for the same input (a resumed run selects
    what the uninterrupted one did) and needs no generator state."""
    x = x.reshape(-1)
    d = x.numel()
    if k <= 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.int64, device=x.device)
    if k >= d:
        indices = torch.arange(d, device=x.device)
        return x.clone(), indices
    magnitude = x.abs()
    if magnitude.dtype not in (torch.float32, torch.float64):
        magnitude = magnitude.float()
    mean, top = magnitude.mean(), magnitude.max()
    # Algorithm 1 searches [mean, max]; when k or fewer elements reach the mean (a dense selection,
    # e.g. density 0.5) the k-th magnitude lies below it, and the text's "halve thres1" goes there:
    # the search then spans [0, max].
    base = torch.where((magnitude >= mean).sum() <= k, torch.zeros_like(mean), mean)
    lower = torch.zeros((), dtype=magnitude.dtype, device=x.device)
    upper = torch.ones((), dtype=magnitude.dtype, device=x.device)
    kept_at_most = torch.zeros((), dtype=torch.int64, device=x.device)  # k1
    kept_more = torch.full((), d, dtype=torch.int64, device=x.device)  # k2
    th1 = torch.full((), float("inf"), dtype=magnitude.dtype, device=x.device)
    th2 = torch.zeros((), dtype=magnitude.dtype, device=x.device)
    for _ in range(samplings):
        ratio = lower + (upper - lower) / 2
        threshold = base + ratio * (top - base)
        count = (magnitude >= threshold).sum()
        few = count <= k
        upper = torch.where(few, ratio, upper)
        lower = torch.where(few, lower, ratio)
        better_few = few & (count > kept_at_most)
        kept_at_most = torch.where(better_few, count, kept_at_most)
        th1 = torch.where(better_few, threshold, th1)
        better_many = ~few & (count < kept_more)
        kept_more = torch.where(better_many, count, kept_more)
        th2 = torch.where(better_many, threshold, th2)
    above = magnitude >= th1
    k1 = above.sum()  # recounted: equal to kept_at_most (0 when th1 stayed infinite)
    between = (~above) & (magnitude >= th2)
    need = k - k1
    span = between.sum() - need  # >= 0: th2 keeps more than k
    mixed = _content_hash(x) if seed is None else torch.tensor(seed, dtype=torch.int64, device=x.device)
    offset = ((mixed * SALT) & 0x7FFFFFFF) % (span + 1)
    order = torch.cumsum(between, 0) - 1  # position of each candidate among the candidates
    window = between & (order >= offset) & (order < offset + need)
    indices = torch.nonzero_static(above | window, size=k).reshape(-1)
    return x[indices], indices


def _content_hash(x: torch.Tensor) -> torch.Tensor:
    """A device scalar from the bits of `x` (no host synchronisation)."""
    bits = x.detach().float().contiguous().view(torch.int32).to(torch.int64)
    return bits.sum() & 0x7FFFFFFF
