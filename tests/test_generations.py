"""DeFT's generations hand the optimizer only complete gradients, and a `.grad` read after the step
keeps the values it stepped with while later generations reuse buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commsched.comm.buckets import build_plan
from commsched.deft.generations import BufferPool, Generation
from commsched.errors import ScheduleError
from commsched.fusion import plan_fixed


def _plan():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return build_plan(model, 1, lambda infos: plan_fixed(infos, cap_bytes=40))


def _generation(plan, pool, number, value):
    generation = Generation(number, pool.take(), plan)
    for b, bucket in enumerate(plan.buckets):
        generation.merge(b, torch.full_like(bucket.buffer, value), first=True)
        generation.used[b] = [True] * len(bucket.params)
    generation.k = 1
    return generation


def test_a_generation_missing_a_piece_refuses_to_step():
    plan = _plan()
    generation = _generation(plan, BufferPool(plan), 0, 1.0)
    generation.sent = {0}
    with pytest.raises(ScheduleError, match=r"items \[1\]"):
        generation.hand_to_optimizer(plan, 2)
    generation.sent = {0, 1}
    generation.hand_to_optimizer(plan, 2)
    assert all(p.grad is not None for b in plan.buckets for p in b.params)


def test_a_grad_read_after_the_step_keeps_its_values_until_zero_grad():
    plan = _plan()
    pool = BufferPool(plan)
    items = len(plan.buckets)
    first = _generation(plan, pool, 0, 1.0)
    first.sent = set(range(items))
    first.hand_to_optimizer(plan, items)
    kept = [p.grad for b in plan.buckets for p in b.params]
    pool.give_back(first.buffers)  # stepped: the buffers go back while .grad still views them
    _generation(plan, pool, 1, 7.0)
    assert all(bool((g == 1.0).all()) for g in kept)
    for b in plan.buckets:  # zero_grad(set_to_none=True)
        for p in b.params:
            p.grad = None
    reused = pool.take()
    assert {t.untyped_storage().data_ptr() for t in reused} == {t.untyped_storage().data_ptr() for t in first.buffers}
