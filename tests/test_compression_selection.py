"""Selecting the largest entries: MSTopK against torch.topk, the sampled threshold, the density warm-up,
1-D tensors sent whole, and refused values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import commsched
from commsched.compression import mstopk, sampled_topk


# ------------------------------------------------------------------ MSTopK
def heavy_tailed(d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(d, generator=g) / torch.rand(d, generator=g).clamp_min(1e-3)


@pytest.mark.parametrize(
    "d, density", [(1000, 0.01), (100_000, 0.01), (100_000, 0.001), (1_000_000, 0.001), (4096, 0.5)]
)
@pytest.mark.parametrize("draw", ["normal", "heavy_tailed"])
def test_mstopk_returns_exactly_k_unique_indices_and_recalls_topk(d, density, draw):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(d, generator=g) if draw == "normal" else heavy_tailed(d, g)
    k = math.ceil(density * d)
    values, indices = mstopk(x, k)
    assert indices.numel() == k and indices.unique().numel() == k
    assert torch.equal(values, x[indices])
    exact = set(torch.topk(x.abs(), k).indices.tolist())
    assert len(exact & set(indices.tolist())) / k >= 0.99


def test_mstopk_recalls_topk_on_real_gradients():
    from commsched.models.resnet import ResNet

    torch.manual_seed(0)
    model = ResNet(18, num_classes=10, cifar_stem=True, width=8)
    F.cross_entropy(model(torch.randn(16, 3, 16, 16)), torch.randint(0, 10, (16,))).backward()
    gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for density in (0.01, 0.001):
        k = math.ceil(density * gradient.numel())
        _, indices = mstopk(gradient, k)
        exact = set(torch.topk(gradient.abs(), k).indices.tolist())
        assert indices.unique().numel() == k
        assert len(exact & set(indices.tolist())) / k >= 0.99, density


@pytest.mark.parametrize(
    "x, k",
    [
        (torch.ones(100), 7),  # every element ties
        (torch.zeros(100), 7),  # nothing to choose between
        (
            torch.cat([torch.full((20,), 5.0), torch.randn(80)]),
            7,
        ),  # more than k tie at the maximum: no threshold keeps <= k
        (torch.randn(50), 50),  # k = d
        (torch.randn(50), 0),  # k = 0
        (torch.tensor([3.0, -3.0, 1.0, -1.0, 0.5]), 3),  # signs: magnitude counts
    ],
)
def test_mstopk_edge_cases_give_exactly_k(x, k):
    values, indices = mstopk(x, k)
    assert indices.numel() == k and indices.unique().numel() == k
    assert torch.equal(values, x[indices])
    others = torch.ones_like(x, dtype=torch.bool)
    others[indices] = False
    if k and others.any():  # these are small enough for the bisection to land on the exact k-th magnitude
        assert x.abs()[indices].min() >= x.abs()[others].max()


def test_mstopk_window_moves_with_the_data_and_is_reproducible():
    ties = torch.ones(1000)
    first = mstopk(ties, 10)[1]
    assert torch.equal(first, mstopk(ties.clone(), 10)[1])
    assert not torch.equal(first, mstopk(ties * 2, 10)[1])


# ------------------------------------------------------------------ the sampled threshold
@pytest.mark.parametrize(
    "d, density", [(1000, 0.01), (100_000, 0.01), (100_000, 0.001), (1_000_000, 0.001), (4096, 0.5), (50, 0.3)]
)
@pytest.mark.parametrize("draw", ["normal", "heavy_tailed", "periodic"])
def test_the_sampled_threshold_selects_exactly_torch_topks_elements(d, density, draw):
    """Exact, not approximate: the same set of magnitudes as torch.topk, whatever the sample saw (a
    periodic tensor whose large values fall between the strided samples needs the fallback)."""
    g = torch.Generator().manual_seed(d)
    if draw == "periodic":
        x = torch.zeros(d)
        x[1::97] = torch.rand(x[1::97].numel(), generator=g) + 1.0
    else:
        x = torch.randn(d, generator=g) if draw == "normal" else heavy_tailed(d, g)
    k = math.ceil(density * d)
    values, indices = sampled_topk(x, k)
    assert indices.numel() == k and indices.unique().numel() == k
    assert torch.equal(values, x[indices])
    expected = torch.topk(x.abs(), k).values
    assert torch.equal(x.abs()[indices].sort(descending=True).values, expected)


def test_the_sampled_threshold_edge_cases():
    assert sampled_topk(torch.randn(10), 0)[1].numel() == 0
    sparse = torch.zeros(100_000)
    sparse[::400] = torch.randn(250, generator=torch.Generator().manual_seed(1))  # fewer non-zeros than k: zeros tie
    assert torch.equal(
        sampled_topk(sparse, 1000)[0].abs().sort().values, torch.topk(sparse.abs(), 1000).values.sort().values
    )
    poisoned = torch.randn(100_000, generator=torch.Generator().manual_seed(2))
    poisoned[12_345] = float("nan")  # between the strided samples: still selected, as torch.topk selects it
    assert 12_345 in sampled_topk(poisoned, 100)[1].tolist()
    values, indices = sampled_topk(torch.arange(5.0), 5)
    assert sorted(indices.tolist()) == [0, 1, 2, 3, 4] and torch.equal(values, torch.arange(5.0)[indices])
    ties = torch.ones(10_000)
    assert sampled_topk(ties, 30)[1].unique().numel() == 30


def test_the_density_falls_fourfold_per_stage_over_the_run_s_first_quarter():
    from commsched.compression.warmup import SparsityWarmup, auto_span, stage_densities

    assert stage_densities(0.01) == [1.0, 0.25, 0.0625, 0.015625, 0.01]
    assert stage_densities(0.001)[-2:] == [0.00390625, 0.001] and stage_densities(0.25) == [1.0, 0.25]
    assert auto_span(32, 96) == (24, "a quarter of this run's 96")  # a quarter of the run...
    assert auto_span(10, 1000) == (40, "4 epochs of 10")  # ...at most four epochs
    assert auto_span(math.inf, math.inf)[0] == 1000
    warmup = SparsityWarmup(0.01, 3, lambda: (16, "as set"))  # after a dense warm-up of 3 steps
    assert [warmup.density(step) for step in (0, 3, 6, 7, 11, 15, 18, 19, 100)] == [
        0.01,
        1.0,
        1.0,
        0.25,
        0.0625,
        0.015625,
        0.015625,
        0.01,
        0.01,
    ]
    assert warmup.end == 19


def test_one_dimensional_parameters_are_sent_whole_beside_the_top_k_of_the_rest():
    """Brute force over every window a rank selects in (the whole bucket, each half-shard): the 1-d
    parameters' positions all go, and the k largest magnitudes among the other positions."""
    from commsched.comm.buckets import Bucket
    from commsched.compression.selections import exact_topk
    from commsched.compression.whole_vectors import WholeVectors

    shapes = [(6, 5), (5,), (4, 3, 2), (7,), (3,), (10, 2)]  # 89 elements, padded to 90
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    buffer = torch.zeros(90)
    buffer[:89] = torch.randn(89, generator=torch.Generator().manual_seed(3))
    bucket = Bucket(0, [f"p{i}" for i in range(len(params))], params, buffer, [], 89, 45)
    is_vector = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in params] + [torch.tensor([False])])
    for start, length in [(0, 90), (0, 45), (45, 45)]:
        x = buffer[start : start + length]
        vectors = is_vector[start : start + length].nonzero().flatten().tolist()
        ranked = (~is_vector[start : start + length]).nonzero().flatten()
        ranked = ranked[ranked + start < 89]  # the padding is not ranked
        window = WholeVectors(bucket, start, length)
        assert window.ranked_numel == ranked.numel() and window.whole_numel == len(vectors)
        for k, select in [(4, exact_topk), (4, mstopk), (0, exact_topk), (ranked.numel(), mstopk)]:
            values, indices = window.select(x, select, k)
            top = ranked[torch.topk(x[ranked].abs(), k).indices].tolist() if k else []
            assert sorted(indices.tolist()) == sorted(vectors + top), (start, k)
            assert torch.equal(values, x[indices])
        plain = WholeVectors(bucket, start, length, enabled=False)
        assert plain.whole_numel == 0 and plain.ranked_numel == min(length, 89 - start)
        assert sorted(plain.select(x, exact_topk, 4)[1].tolist()) == sorted(torch.topk(x.abs(), 4).indices.tolist())
    padding_only = Bucket(0, ["p"], [torch.nn.Parameter(torch.zeros(3, 1))], torch.zeros(4), [], 3, 2)
    assert WholeVectors(padding_only, 3, 1).ranked_numel == 1  # a window of padding alone still sends one element


def test_bad_compression_values_are_refused_before_spawning():
    with pytest.raises(commsched.CommSchedConfigError, match=r"CompressionOptions\(density=0.0\)"):
        commsched.WFBPStrategy(compression=commsched.CompressionOptions(method="mstopk", density=0.0))
    with pytest.raises(
        commsched.CommSchedConfigError,
        match=r"WFBPStrategy\(compression='gzip'\); allowed: one of 'none', 'auto', 'topk', 'sampled', 'mstopk'",
    ):
        commsched.WFBPStrategy(compression="gzip")
    with pytest.raises(commsched.CommSchedConfigError, match=r"CompressionOptions\(method='mstopk'\).*schedule dear"):
        commsched.DeARStrategy(compression="mstopk")
    with pytest.raises(
        commsched.CommSchedConfigError,
        match=r"CompressionOptions\(sparsity_warmup_steps=-1\); allowed: an integer >= 0 or \"auto\"",
    ):
        commsched.WFBPStrategy(compression=commsched.CompressionOptions(method="topk", sparsity_warmup_steps=-1))
    with pytest.raises(commsched.CommSchedConfigError, match=r"CompressionOptions\(samplings=0\)"):
        commsched.WFBPStrategy(compression=commsched.CompressionOptions(method="mstopk", samplings=0))
