"""DeFT's planning, without processes: solvers against brute force, the plan's invariants, the Gaussian
walk against Monte Carlo, gradient statistics, predictions against the simulator, the choice of
schedule, and weight prediction's arithmetic."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from commsched.deft.iteration_model import (
    balanced_links,
    choose_schedule,
    dear_is_faster,
    dear_seconds,
    plan_seconds,
    ranked,
)
from commsched.deft.plan import (
    BACKWARD,
    FORWARD,
    DeFTPlan,
    Item,
    Iteration,
    Launch,
    Timings,
    no_delay_plan,
    plan_for,
    solve_plan,
)
from commsched.deft.solvers import NONE, knapsack_exact, multi_knapsack_exact, multi_knapsack_greedy, recursive_knapsack
from commsched.deft.walk import WalkState, effective_step, expected_next, gradient_statistics, measured_step, plan_ratio
from commsched.sim.timelines import dear as simulated_dear
from commsched.sim.timelines import wfbp as simulated_wfbp
from commsched.sim.workload import Layer, Workload
from conftest import run_worker


def brute_knapsack(weights, capacity):
    best = 0.0
    for r in range(len(weights) + 1):
        for subset in itertools.combinations(range(len(weights)), r):
            load = sum(weights[i] for i in subset)
            if load <= capacity + 1e-12:
                best = max(best, load)
    return best


def brute_multi(weights, capacities, values):
    best = 0.0
    for links in itertools.product([NONE, *range(len(capacities))], repeat=len(values)):
        load = [sum(weights[l][i] for i, li in enumerate(links) if li == l) for l in range(len(capacities))]
        if all(x <= c + 1e-12 for x, c in zip(load, capacities)):
            best = max(best, sum(values[i] for i, l in enumerate(links) if l != NONE))
    return best


def random_instance(rng, n, mu=None):
    primary = [rng.uniform(0.1, 2.0) for _ in range(n)]
    mu = mu or rng.uniform(1.0, 2.5)
    return [primary, [c * mu for c in primary]], primary


def test_knapsack_exact_equals_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.uniform(0.1, 3.0) for _ in range(rng.randint(1, 10))]
        capacity = rng.uniform(0.5, 8.0)
        chosen = knapsack_exact(weights, capacity)
        assert sum(weights[i] for i in chosen) <= capacity + 1e-12
        assert sum(weights[i] for i in chosen) == pytest.approx(brute_knapsack(weights, capacity), abs=1e-9)


def test_multi_knapsack_exact_equals_brute_force_and_greedy_is_within_half():
    rng = random.Random(1)
    strictly_worse = 0
    for _ in range(200):
        n = rng.randint(1, 7)
        weights, values = random_instance(rng, n)
        # the greedy's bound holds when every item fits every knapsack: at least half the optimum
        capacities = [rng.uniform(max(weights[0]), 6.0), 0.0]
        capacities[1] = rng.uniform(max(weights[1]), 8.0)
        best = brute_multi(weights, capacities, values)
        exact = multi_knapsack_exact(weights, capacities, values)
        greedy = multi_knapsack_greedy(weights, capacities, values)
        assert exact.value == pytest.approx(best, abs=1e-9)
        for assignment in (exact, greedy):
            for link, capacity in enumerate(capacities):
                assert sum(weights[link][i] for i in assignment.chosen(link)) <= capacity + 1e-12
        assert greedy.value >= 0.5 * best - 1e-9
        strictly_worse += greedy.value < best - 1e-9
    assert strictly_worse > 0  # the instances are hard enough to tell the two apart


def test_recursive_knapsack_is_the_best_suffix_and_never_worse_than_its_inner_solver():
    rng = random.Random(2)
    for _ in range(100):
        n = rng.randint(1, 6)
        weights, values = random_instance(rng, n)
        backward = [rng.uniform(0.05, 0.8) for _ in range(n)]
        capacities = [rng.uniform(0.5, 4.0)] * 2
        result = recursive_knapsack(weights, capacities, values, backward, solve=multi_knapsack_exact)
        lost, best = 0.0, 0.0
        for start in range(n):  # brute force over every suffix and every assignment of it
            lost += backward[start] if start else 0.0
            room = [c - lost for c in capacities]
            if max(room) > 0:
                best = max(best, brute_multi([w[start:] for w in weights], room, values[start:]))
        assert result.value == pytest.approx(best, abs=1e-9)
        greedy_rk = recursive_knapsack(weights, capacities, values, backward, solve=multi_knapsack_greedy)
        assert greedy_rk.value >= multi_knapsack_greedy(weights, capacities, values).value - 1e-9


def check_plan(plan: DeFTPlan, timings: Timings, repeats: int = 3) -> None:
    """Each item of each generation sent exactly once, never before the generation exists (its last
    iteration's own items only in that iteration's backward), every stage within capacity, each
    generation stepped once, in order, after its last item; sum(K) = N."""
    assert sum(plan.k) == plan.n
    total = len(plan.prefix) + repeats * plan.n
    joined: dict[int, list[int]] = {}
    sent: dict[int, set] = {}
    stepped: list[int] = []
    staleness = 0
    for t in range(total):
        it = plan.at(t)
        joined.setdefault(it.joins, []).append(t)
        for stage, cap in ((FORWARD, timings.forward), (BACKWARD, sum(timings.backward))):
            for link in range(2):
                load = sum(timings.costs[link][l.item] for l in it.launches if l.stage == stage and l.link == link)
                assert load <= plan.capacity * cap + 1e-9
        for launch in it.launches:
            assert launch.generation in joined, "sent before any iteration joined it"
            assert launch.generation not in stepped
            last = joined[launch.generation][-1]
            assert t >= last and not (t == last and launch.stage == FORWARD and launch.generation == it.joins)
            assert launch.item not in sent.setdefault(launch.generation, set()), "sent twice"
            sent[launch.generation].add(launch.item)
        for g in it.steps:
            assert sent.get(g) == set(range(len(plan.items))), "stepped before every item was reduced"
            assert not stepped or g > stepped[-1]
            stepped.append(g)
            staleness = max(staleness, t - joined[g][-1])
        assert all(g not in joined or t2 <= t for g in it.steps for t2 in joined[g])
    assert plan.staleness == staleness


def test_plans_hold_their_invariants_and_use_both_links():
    rng = random.Random(3)
    both = delayed = 0
    for _ in range(60):
        n = rng.randint(1, 8)
        primary = [rng.uniform(0.1, 3.0) for _ in range(n)]
        mu = rng.uniform(1.1, 2.5)
        bucket_timings = Timings(
            rng.uniform(0.5, 3.0), [rng.uniform(0.1, 0.8) for _ in range(n)], [primary, [c * mu for c in primary]]
        )
        numels = [rng.randint(10, 1000) for _ in range(n)]
        capacity = rng.choice([0.5, 1.0, 2.0])
        plan = plan_for(numels, bucket_timings, capacity)
        # the items' own timings (pieces of buckets) are what the capacities hold for
        share = [i.numel / numels[i.bucket] for i in plan.items]
        items = Timings(
            bucket_timings.forward,
            [bucket_timings.backward[i.bucket] if i.start == 0 else 0 for i in plan.items],
            [[c[i.bucket] * f for i, f in zip(plan.items, share)] for c in bucket_timings.costs],
        )
        check_plan(plan, items)
        assert all(sum(i.numel for i in plan.items if i.bucket == b) == numels[b] for b in range(n))
        assert DeFTPlan.from_json(json.loads(json.dumps(plan.to_json()))).digest() == plan.digest()
        both += len({l.link for it in plan.period for l in it.launches}) == 2
        delayed += plan.delayed
    assert both > 10 and delayed > 10


def test_enough_capacity_means_no_delay():
    timings = Timings(1.0, [0.5, 0.5], [[0.1, 0.1], [0.2, 0.2]])
    plan = solve_plan([Item(0, 0, 10), Item(1, 0, 10)], timings, capacity=1.0)
    assert plan.k == (1,) and plan.n == 1 and not plan.delayed
    assert plan_for([10, 10], timings, math.inf).k == (1,)


def test_a_bucket_larger_than_the_smallest_knapsack_is_cut():
    plan = plan_for([1000], Timings(0.3, [0.5], [[1.0], [1.5]]), 1.0)
    assert len(plan.items) == 4 and sum(i.numel for i in plan.items) == 1000
    with pytest.raises(ValueError, match="smallest knapsack"):
        solve_plan([Item(0, 0, 1000)], Timings(0.3, [0.5], [[1.0], [1.5]]), 1.0)


def test_walk_closed_form_matches_monte_carlo():
    g = torch.Generator().manual_seed(0)
    for s, eta, mu, sigma, batch in [(2.0, 0.1, 3.0, 4.0, 8), (0.3, 0.5, 0.4, 6.0, 16), (1.0, 0.01, 1.0, 0.5, 32)]:
        draws = mu + sigma / math.sqrt(batch) * torch.randn(400_000, generator=g, dtype=torch.float64)
        monte_carlo = (0.1 + (s - 0.1 - eta * draws).abs()).mean().item()
        assert expected_next(s, 0.1, eta, mu, sigma, batch) == pytest.approx(monte_carlo, rel=2e-3)


def test_plan_ratio_is_one_without_delay_and_grows_with_it():
    state = WalkState(loss=2.0, lr=0.1, mu=1.0, sigma=3.0, batch=16)
    assert plan_ratio(state, [1, 1, 1, 1]) == pytest.approx(1.0)
    assert plan_ratio(state, [4]) > plan_ratio(state, [2, 2]) > 1.0


def probes_of_a_known_gradient(dims: int, noise: float, local_batch: int, ranks: int, probes: int, norm: float = 1.5):
    """What the probes measure on ranks whose batch means are g + N(0, noise^2 I / b): the true |g|^2
    and per-sample sd along any direction are known (norm^2 and noise)."""
    rng = torch.Generator().manual_seed(dims)
    true = torch.zeros(dims, dtype=torch.float64)
    true[0] = norm
    projections, squared_norms = [], []
    for _ in range(probes):
        means = true + noise / math.sqrt(local_batch) * torch.randn(ranks, dims, generator=rng, dtype=torch.float64)
        overall = means.mean(0)
        projections.append((means @ overall / overall.norm()).tolist())
        squared_norms.append((means * means).sum(1).tolist())
    return projections, squared_norms


@pytest.mark.parametrize("dims, ranks", [(1, 4), (50, 4), (50, 2), (10, 8)])
def test_gradient_statistics_land_within_ten_percent_of_the_truth(dims, ranks):
    """50 noisy dimensions make the mean's squared norm 3.8x |g|^2 (tr(Sigma)/(bR) = 6.25 against
    2.25): an estimate that keeps that bias fails by far."""
    projections, squared_norms = probes_of_a_known_gradient(dims, noise=2.0, local_batch=8, ranks=ranks, probes=3000)
    mu, sigma = gradient_statistics(projections, squared_norms, local_batch=8)
    assert mu == pytest.approx(1.5**2, rel=0.1)
    assert sigma == pytest.approx(1.5 * 2.0, rel=0.1)  # sd of a sample's progress <grad L, g_i> = |g| * noise


def test_the_walk_predicts_the_loss_decrease_of_a_real_run(tmp_path):
    """Least squares over 64 noisy dimensions, two ranks, SGD with momentum 0.5: the walk's inputs as
    DeFT measured them predict the drop of the whole data set's loss over the next 12 steps. The
    gradient noise would inflate mu by half (tr(Sigma)/B against |grad L|^2) and forgetting momentum
    would halve eta: either misses the drop by far more than the 12% allowed."""
    from commsched.deft.walk import expected_after

    proc = run_worker("run_walk.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = torch.load(tmp_path / "walk.pt", weights_only=False)
    walk, t, n = WalkState(**run["walk"]), run["read_at"], run["after"]
    assert walk.lr == pytest.approx(run["lr"] / (1 - run["momentum"]))
    assert walk.mu == pytest.approx(run["gradient_norm2"][t], rel=0.15)
    predicted_drop = walk.loss - expected_after(walk, [1] * n)
    measured_drop = run["loss"][t] - run["loss"][t + n]
    assert predicted_drop == pytest.approx(measured_drop, rel=0.12), (predicted_drop, measured_drop)


def test_the_effective_step_is_read_from_sgd_and_measured_for_others():
    from torch import nn

    assert effective_step(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)) == pytest.approx(0.05)
    assert effective_step(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05, momentum=0.9)) == pytest.approx(0.5)
    assert effective_step(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.5, dampening=0.5)
    ) == pytest.approx(0.1)
    weight = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    sgd = torch.optim.SGD([weight], lr=0.2)
    weight.grad = torch.tensor([0.3, 0.1, -0.4])
    before = weight.detach().clone()
    sgd.step()
    assert measured_step(
        float(((weight.detach() - before) * weight.grad).sum()), float((weight.grad**2).sum())
    ) == pytest.approx(0.2)
    adam = torch.optim.Adam(
        [weight], lr=0.01
    )  # a first Adam step moves every coordinate by lr: eta = lr * sum|g| / |g|^2
    before = weight.detach().clone()
    adam.step()
    g = weight.grad
    expected = 0.01 * float(g.abs().sum()) / float((g**2).sum())
    assert measured_step(float(((weight.detach() - before) * g).sum()), float((g**2).sum())) == pytest.approx(
        expected, rel=1e-3
    )


class PerBucketCosts:
    """A cost model that knows each bucket by its (unique) size: the simulator on measured per-bucket times."""

    def __init__(self, nbytes, all_reduce, reduce_scatter, all_gather):
        self.table = {
            "all_reduce": dict(zip(nbytes, all_reduce)),
            "reduce_scatter": dict(zip(nbytes, reduce_scatter)),
            "all_gather": dict(zip(nbytes, all_gather)),
        }

    def time(self, collective, nbytes, workers):
        return self.table[collective][nbytes]


def test_predictions_agree_with_the_simulator():
    """plan_seconds of DDP's plan is the simulator's WFBP and dear_seconds its DeAR, on the same buckets."""
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 7)
        backward = [rng.uniform(0.0, 1.0) for _ in range(n)]
        forward = rng.uniform(0.1, 3.0)
        all_reduce = [rng.uniform(0.0, 2.0) for _ in range(n)]
        halves = [[c * rng.uniform(0.3, 0.8) for c in all_reduce] for _ in range(2)]
        numels = list(range(100, 100 + n))
        total = sum(backward) or 1.0
        # bucket b (backward order) is layer n-1-b (forward order); its forward is its share of the backward
        layers = tuple(
            Layer(
                f"l{i}",
                numels[n - 1 - i],
                forward * (backward[n - 1 - i] / total if sum(backward) else 1 / n),
                backward[n - 1 - i],
            )
            for i in range(n)
        )
        workload = Workload("random", layers, 1)
        costs = PerBucketCosts(numels, all_reduce, *halves)
        buckets = [[n - 1 - b] for b in range(n)]
        timings = Timings(forward, backward, [all_reduce, [math.inf] * n])
        ddp = plan_seconds(no_delay_plan([Item(b, 0, numels[b]) for b in range(n)]), timings, numels)
        assert ddp == pytest.approx(simulated_wfbp(workload, costs, 2, buckets).iteration_s)
        assert dear_seconds(forward, backward, [halves[0]], [halves[1]]) == pytest.approx(
            simulated_dear(workload, costs, 2, buckets).iteration_s
        )


def test_dear_is_chosen_only_when_clearly_faster():
    # one bucket: nothing for DeAR to overlap, its two halves cost more than the all-reduce
    assert dear_seconds(1.0, [1.0], [[0.6]], [[0.6]]) == pytest.approx(3.2)
    assert plan_seconds(
        no_delay_plan([Item(0, 0, 10)]), Timings(1.0, [1.0], [[1.0], [math.inf]]), [10]
    ) == pytest.approx(3.0)
    assert not dear_is_faster(3.0, 3.2)
    # many buckets on a slow link: DeAR hides the all-gathers under the next forward
    timings = Timings(1.0, [0.25] * 4, [[1.0] * 4, [math.inf] * 4])
    plan_s = plan_seconds(no_delay_plan([Item(b, 0, 10) for b in range(4)]), timings, [10] * 4)
    dear_s = dear_seconds(1.0, [0.25] * 4, [[0.5] * 4], [[0.5] * 4])
    assert plan_s == pytest.approx(1.0 + 0.25 + 4.0) and dear_s < plan_s and dear_is_faster(plan_s, dear_s)
    assert not dear_is_faster(1.0, 0.99)  # within the margin: keep the plan


def test_the_choice_of_schedule():
    items = [Item(b, 0, 10) for b in range(4)]
    ddp, numels = no_delay_plan(items), [10] * 4
    timings = Timings(1.0, [0.25] * 4, [[1.0] * 4, [1.0] * 4])
    slow_halves = ([[2.0] * 4], [[2.0] * 4])
    fast_halves = ([[0.5] * 4, [0.5] * 4], [[0.5] * 4, [0.5] * 4])
    assert ddp.is_ddp and choose_schedule(ddp, timings, numels, "when_faster", None).runs == "wfbp"
    assert choose_schedule(ddp, timings, numels, "when_faster", slow_halves).runs == "wfbp"
    assert choose_schedule(ddp, timings, numels, "when_undelayed", slow_halves).runs == "dear"
    assert choose_schedule(ddp, timings, numels, "never", fast_halves).runs == "plan"
    fast = choose_schedule(ddp, timings, numels, "when_faster", fast_halves)
    assert fast.runs == "dear" and set(fast.dear_links) == {"primary", "secondary"}
    assert fast.predicted["dear_ms"] < fast.predicted["wfbp_ms"] and "plan_ms" not in fast.predicted
    assert fast.alternative == ("wfbp", ())
    delayed = plan_for(numels, timings, 0.5)
    assert delayed.delayed and not delayed.is_ddp
    assert choose_schedule(delayed, timings, numels, "when_faster", None).runs == "plan"
    assert choose_schedule(delayed, timings, numels, "when_undelayed", fast_halves).runs == "plan"


def test_wfbp_on_the_primary_competes_with_a_plan_that_spreads_buckets_over_two_links():
    """An undelayed plan over both links is not DDP's schedule, yet WFBP on the primary stays a
    candidate: where the plan is predicted no clearly faster, WFBP runs and the plan is timed against it."""
    numels = [10] * 4
    both_links = Iteration(0, tuple(Launch(0, i, i % 2, BACKWARD) for i in range(4)), (0,))
    spread = DeFTPlan([Item(b, 0, 10) for b in range(4)], (), (both_links,), 1, math.inf, (1,))
    assert not spread.delayed and not spread.is_ddp
    compute_bound = Timings(4.0, [1.0] * 4, [[0.1] * 4, [0.1] * 4])  # every all-reduce hides under backward
    slow_halves = ([[2.0] * 4, [2.0] * 4], [[2.0] * 4, [2.0] * 4])
    tie = choose_schedule(spread, compute_bound, numels, "when_faster", slow_halves)
    assert tie.predicted["plan_ms"] == pytest.approx(tie.predicted["wfbp_ms"])
    assert tie.runs == "wfbp" and tie.alternative == ("plan", ())
    network_bound = Timings(0.1, [0.1] * 4, [[1.0] * 4, [1.0] * 4])  # two links halve the exposed time
    faster = choose_schedule(spread, network_bound, numels, "when_faster", slow_halves)
    assert faster.predicted["plan_ms"] < 0.7 * faster.predicted["wfbp_ms"]
    assert faster.runs == "plan" and faster.alternative == ("wfbp", ())


def test_a_candidate_passes_a_simpler_one_only_when_clearly_faster():
    assert ranked({"wfbp": 1.0, "dear": 0.99, "plan": 0.5}) == ["plan", "wfbp", "dear"]
    assert ranked({"plan": 0.985, "dear": 0.97, "wfbp": 1.0}) == ["dear", "wfbp", "plan"]
    assert ranked({"plan": 0.975, "dear": 0.97, "wfbp": 1.0}) == ["dear", "plan", "wfbp"]
    assert ranked({"wfbp": 1.0, "plan": 0.99}) == ["wfbp", "plan"]
    assert ranked({"wfbp": 1.0}) == ["wfbp"]


def test_dear_over_two_links_balances_the_buckets():
    halves = [[0.5] * 4, [0.75] * 4]  # the secondary 1.5x slower
    link_of = balanced_links(halves, halves)
    assert link_of == [0, 1, 0, 0]  # the slower link takes what it can finish no later than the primary
    one = dear_seconds(1.0, [0.25] * 4, halves, halves, [0] * 4)
    assert one == pytest.approx(dear_seconds(1.0, [0.25] * 4, halves[:1], halves[:1]))
    two = dear_seconds(1.0, [0.25] * 4, halves, halves, link_of)
    assert two < one
    # by hand: forward ends at 1.75 (b3, b2, b0 gathered on the primary by 0.5, 1.0, 1.5; b1 on the
    # secondary by 0.75); backward's reduce-scatters end at 2.5 (b0), 3.0 (b1 secondary), 3.0, 3.5
    assert (one, two) == (pytest.approx(4.5), pytest.approx(3.5))


def test_when_everything_fits_both_links_share_the_work():
    """The paper's smallest-knapsack-first rule would put every item on the slower link here."""
    primary = [1.0] * 8
    weights, capacities = [primary, [1.6] * 8], [20.0, 20.0]
    for assignment in (
        multi_knapsack_greedy(weights, capacities, primary),
        multi_knapsack_exact(weights[:], capacities, primary),
    ):
        assert len(assignment.chosen()) == 8
        assert assignment.chosen(0) and assignment.chosen(1)


def test_weight_prediction_extrapolates_the_last_update_restores_exactly_and_forgets():
    from commsched.deft.weight_prediction import WeightPrediction

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    prediction = WeightPrediction([w], ["w"])
    prediction.predict(1)  # no step seen yet: nothing to extrapolate
    assert w.tolist() == [1.0, 2.0]
    prediction.before_step()
    with torch.no_grad():
        w.sub_(torch.tensor([0.5, -0.25]))  # the update: -0.5, +0.25
    stepped = w.data_ptr()
    prediction.predict(2)
    assert w.tolist() == [-0.5, 2.75]  # two more updates like the last
    prediction.restore()
    assert w.data_ptr() == stepped and w.tolist() == [0.5, 2.25]  # the weights themselves, not a copy
    saved = prediction.state()
    prediction.forget()  # an exact schedule's steps came between
    prediction.predict(1)
    assert w.tolist() == [0.5, 2.25] and prediction.state() == {}
    prediction.load(saved)
    prediction.predict(1)
    assert w.tolist() == [0.0, 2.5]
    prediction.restore()
