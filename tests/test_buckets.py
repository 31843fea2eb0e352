"""Bucket planning: deterministic, dtype-pure, padded, frozen parameters excluded, tied ones once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commsched.comm.buckets import build_plan, trainable_in_ready_order
from commsched.fusion import ParamInfo, plan_fixed, plan_layers


def _info(numel: int, layer: int, dtype=torch.float32) -> ParamInfo:
    return ParamInfo(f"p{layer}", numel, torch.empty(0, dtype=dtype).element_size(), dtype, torch.device("cpu"), layer)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.half = nn.Linear(5, 3).to(torch.float64)
        self.out = nn.Linear(5, 7)
        self.out.weight = self.embed.weight


def test_fixed_closes_a_bucket_once_it_reaches_the_cap_as_ddp_does():
    params = [_info(n, i) for i, n in enumerate([10, 10, 10, 30, 5])]
    assert plan_fixed(params, cap_bytes=80) == [[0, 1], [2, 3], [4]]


def test_fixed_buckets_are_ddps_own_assignment():
    """Against torch's C++ assignment (what DDP's reducer builds), on random models: the same buckets
    for the same caps (DDP's first bucket 1 MiB, then the cap)."""
    import random

    import torch.distributed as dist

    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 7, 100, 2**14, 2**16, 2**18, 2**19]) for _ in range(rng.randint(1, 30))]
        cap = rng.choice([2**10, 2**16, 2**20, 25 * 2**20])
        first = min(cap, 2**20)
        expected, _ = dist._compute_bucket_assignment_by_size([torch.zeros(n) for n in sizes], [first, cap])
        assert plan_fixed([_info(n, i) for i, n in enumerate(sizes)], cap_bytes=cap) == expected, (sizes, cap)


def test_fixed_first_bucket_is_small_like_ddp():
    params = [_info(2**17, i) for i in range(6)]  # 512 KiB each
    assert plan_fixed(params, cap_bytes=25 * 2**20) == [[0, 1], [2, 3, 4, 5]]  # first bucket <= 1 MiB
    assert plan_fixed(params, cap_bytes=25 * 2**20, first_cap_bytes=25 * 2**20) == [[0, 1, 2, 3, 4, 5]]


def test_fixed_never_mixes_dtypes():
    params = [_info(4, 0), _info(4, 1, torch.float64), _info(4, 2)]
    assert plan_fixed(params, cap_bytes=10**9) == [[0], [1], [2]]


def test_layers_groups_n_consecutive_layers():
    params = [_info(3, layer) for layer in (0, 0, 1, 2, 2, 3, 4)]
    assert plan_layers(params, layers_per_bucket=2) == [[0, 1, 2], [3, 4, 5], [6]]


def test_ready_order_excludes_frozen_and_lists_tied_once():
    names, params, _ = trainable_in_ready_order(Tied())
    assert "frozen.weight" not in names and "frozen.bias" not in names
    assert names.count("embed.weight") == 1 and "out.weight" not in names
    assert names[0] == "out.bias"  # reverse registration order: last layer's gradient is ready first


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_buffers_padded_to_world_size_with_zero_padding_and_views_in_place(world):
    model = Tied()
    plan = build_plan(model, world, lambda infos: plan_fixed(infos, cap_bytes=64))
    for bucket in plan.buckets:
        assert bucket.buffer.numel() % world == 0
        assert bucket.shard_numel * world == bucket.buffer.numel()
        assert torch.count_nonzero(bucket.buffer) == 0
        assert len({p.dtype for p in bucket.params}) == 1
        for param, view, start in zip(bucket.params, bucket.views, bucket.offsets()):
            assert view.shape == param.shape
            assert view.data_ptr() == bucket.buffer.data_ptr() + start * bucket.buffer.element_size()


def test_plan_signature_is_deterministic():
    a = build_plan(Tied(), 2, lambda i: plan_fixed(i, 100))
    b = build_plan(Tied(), 2, lambda i: plan_fixed(i, 100))
    assert a.signature() == b.signature()
    c = build_plan(Tied(), 3, lambda i: plan_fixed(i, 100))
    assert a.signature() != c.signature()


def test_buckets_cut_where_the_optimizer_changes():
    """A GAN's two halves in one 25 MB bucket, cut in two: each keeps the planner's order, none holds both."""
    gan = nn.ModuleDict({"g": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), "d": nn.Sequential(nn.Linear(4, 1))})
    owner = {id(p): 0 for p in gan["g"].parameters()} | {id(p): 1 for p in gan["d"].parameters()}
    whole = build_plan(gan, 2, lambda infos: [list(range(len(infos)))])
    cut = build_plan(gan, 2, lambda infos: [list(range(len(infos)))], apart=lambda p: owner[id(p)])
    assert len(whole.buckets) == 1
    assert [b.names for b in cut.buckets] == [["d.0.bias", "d.0.weight"], [n for n in whole.buckets[0].names[2:]]]
    assert [n for b in cut.buckets for n in b.names] == whole.buckets[0].names
