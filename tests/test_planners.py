"""Fusion planners (issue 5): the exact programmes against brute force, the greedy baseline, the
DeAR model against the simulator, and the per-instance bound."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from commsched.fusion.dear_model import DearInstance, min_backward, min_forward, plan_dear_model
from commsched.fusion.mgwfbp import chain_end, plan_exact, plan_greedy
from commsched.sim import AlphaBeta, Layer, Workload, builtin, schedules


def partitions(n: int):
    """Every split of range(n) into consecutive groups."""
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        groups, current = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        yield groups


def random_chain(rng: random.Random, n: int):
    ready = sorted(rng.uniform(0, 0.05) for _ in range(n))
    nbytes = [rng.randint(1, 4 * 10**6) for _ in range(n)]
    a, b = rng.uniform(0, 5e-3), rng.uniform(1e-10, 1e-8)
    return ready, nbytes, (lambda m: a + b * m)


def test_exact_plan_equals_brute_force_and_never_loses_to_greedy():
    rng = random.Random(0)
    greedy_lost = 0
    for _ in range(300):
        ready, nbytes, cost = random_chain(rng, rng.randint(1, 9))
        groups, end = plan_exact(ready, nbytes, cost)
        brute = min(chain_end(p, ready, nbytes, cost) for p in partitions(len(ready)))
        assert end == pytest.approx(brute, rel=1e-12)
        assert chain_end(groups, ready, nbytes, cost) == pytest.approx(end, rel=1e-12)
        assert sorted(i for g in groups for i in g) == list(range(len(ready)))
        greedy = chain_end(plan_greedy(ready, nbytes, cost), ready, nbytes, cost)
        assert end <= greedy + 1e-12
        greedy_lost += end < greedy - 1e-12
    assert greedy_lost > 0  # the greedy rule is not optimal (DESIGN.md §5): the comparison must show it


def random_dear(rng: random.Random, n: int) -> DearInstance:
    forward = [rng.uniform(0, 0.01) for _ in range(n)]
    backward = [f * rng.uniform(1, 3) for f in forward]
    fsuf = [sum(forward[i:]) for i in range(n)]
    ready = [sum(backward[i:]) for i in range(n)]
    nbytes = [rng.randint(1, 4 * 10**6) for _ in range(n)]
    a, b = rng.uniform(0, 3e-3), rng.uniform(1e-10, 1e-8)
    cost = lambda m: a + b * m  # noqa: E731
    return DearInstance(fsuf, ready, nbytes, cost, cost, sum(forward), sum(backward))


def test_dear_parts_are_exact_and_their_sum_bounds_every_plan():
    rng = random.Random(1)
    for _ in range(150):
        instance = random_dear(rng, rng.randint(1, 8))
        every = list(partitions(instance.units))
        assert min_forward(instance)[1] == pytest.approx(min(instance.forward_time(p) for p in every), rel=1e-12)
        assert min_backward(instance)[1] == pytest.approx(min(instance.backward_time(p) for p in every), rel=1e-12)
        optimum = min(instance.time(p) for p in every)
        plan = plan_dear_model(instance)
        assert plan.lower_bound <= optimum * (1 + 1e-12)
        assert optimum <= plan.predicted * (1 + 1e-12) <= plan.lower_bound * (1 + plan.gap) * (1 + 1e-9)
        assert plan.predicted == pytest.approx(instance.time(plan.groups))


def test_dear_model_finds_the_optimum_on_most_small_instances():
    rng = random.Random(2)
    hits = 0
    for _ in range(100):
        instance = random_dear(rng, rng.randint(2, 8))
        optimum = min(instance.time(p) for p in partitions(instance.units))
        hits += math.isclose(plan_dear_model(instance).predicted, optimum, rel_tol=1e-9)
    assert hits >= 90


@pytest.mark.parametrize("workload", ["resnet50", "vgg16", "gpt2"])
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_dear_model_prediction_is_the_simulated_time_and_beats_fixed_buckets(workload, algorithm):
    w = builtin(workload)
    for workers in (2, 16, 256):
        network = AlphaBeta.from_rate(10e9, 50e-6, algorithm)
        buckets, plan = schedules.dear_model_buckets(w, network, workers)
        simulated = schedules.dear(w, network, workers, buckets).iteration_s
        assert simulated == pytest.approx(plan.predicted, rel=1e-9)
        assert plan.gap < 0.05
        for cap in (1, 5, 25, 100):
            fixed = schedules.dear(w, network, workers, schedules.fixed_size(w, cap * 2**20)).iteration_s
            assert simulated <= fixed * (1 + 1e-9)


def test_planners_cover_every_layer_with_gradients_once():
    workload = Workload("w", (Layer("a", 100, 0.01, 0.02), Layer("relu", 0, 0.001, 0.001), Layer("b", 300, 0.01, 0.02),
                              Layer("c", 50, 0.02, 0.04)), 1)
    network = AlphaBeta(1e-3, 1e-9)
    for buckets in (schedules.mgwfbp_buckets(workload, network, 2), schedules.mgwfbp_buckets(workload, network, 2, exact=False),
                    schedules.dear_model_buckets(workload, network, 2)[0]):
        assert sorted(i for b in buckets for i in b) == [0, 2, 3]
        assert [max(b) for b in buckets] == sorted((max(b) for b in buckets), reverse=True)  # backward order
