"""DeFT: solvers against brute force, the plan's invariants, the Gaussian walk against Monte Carlo,
and real 2-process Lightning runs: no delay == ddp, a forced delayed plan == a single-process
replay of the same merges and staleness, resume == uninterrupted, the Preserver's decisions."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from commsched.deft.plan import BACKWARD, FORWARD, DeFTPlan, Item, Timings, no_delay_plan, plan_for, solve_plan
from commsched.deft.predict import balanced_links, choose_schedule, dear_is_faster, dear_seconds, plan_seconds
from commsched.deft.stability import Stepper, largest_stable_curvature
from commsched.deft.solvers import (NONE, knapsack_exact, multi_knapsack_exact, multi_knapsack_greedy,
                                    recursive_knapsack)
from commsched.deft.walk import WalkState, effective_step, expected_next, gradient_statistics, measured_step, plan_ratio
from commsched.sim.schedules import dear as simulated_dear
from commsched.sim.schedules import wfbp as simulated_wfbp
from commsched.sim.workload import Layer, Workload
from conftest import WORKERS, max_abs_diff, per_link, run_worker

# ----------------------------------------------------------------------------- solvers


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


# ------------------------------------------------------------------------------- plan


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
        bucket_timings = Timings(rng.uniform(0.5, 3.0), [rng.uniform(0.1, 0.8) for _ in range(n)], [primary, [c * mu for c in primary]])
        numels = [rng.randint(10, 1000) for _ in range(n)]
        capacity = rng.choice([0.5, 1.0, 2.0])
        plan = plan_for(numels, bucket_timings, capacity)
        # the items' own timings (pieces of buckets) are what the capacities hold for
        share = [i.numel / numels[i.bucket] for i in plan.items]
        items = Timings(bucket_timings.forward, [bucket_timings.backward[i.bucket] if i.start == 0 else 0 for i in plan.items],
                        [[c[i.bucket] * f for i, f in zip(plan.items, share)] for c in bucket_timings.costs])
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


# ------------------------------------------------------------------------------- walk


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
    assert effective_step(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.5, dampening=0.5)) == pytest.approx(0.1)
    weight = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    sgd = torch.optim.SGD([weight], lr=0.2)
    weight.grad = torch.tensor([0.3, 0.1, -0.4])
    before = weight.detach().clone()
    sgd.step()
    assert measured_step(float(((weight.detach() - before) * weight.grad).sum()), float((weight.grad**2).sum())) == pytest.approx(0.2)
    adam = torch.optim.Adam([weight], lr=0.01)  # a first Adam step moves every coordinate by lr: eta = lr * sum|g| / |g|^2
    before = weight.detach().clone()
    adam.step()
    g = weight.grad
    expected = 0.01 * float(g.abs().sum()) / float((g**2).sum())
    assert measured_step(float(((weight.detach() - before) * g).sum()), float((g**2).sum())) == pytest.approx(expected, rel=1e-3)


# ------------------------------------------------------------- predictions


class PerBucketCosts:
    """A cost model that knows each bucket by its (unique) size: the simulator on measured per-bucket times."""

    def __init__(self, nbytes, all_reduce, reduce_scatter, all_gather):
        self.table = {"all_reduce": dict(zip(nbytes, all_reduce)), "reduce_scatter": dict(zip(nbytes, reduce_scatter)),
                      "all_gather": dict(zip(nbytes, all_gather))}

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
        layers = tuple(Layer(f"l{i}", numels[n - 1 - i], forward * (backward[n - 1 - i] / total if sum(backward) else 1 / n),
                             backward[n - 1 - i]) for i in range(n))
        workload = Workload("random", layers, 1)
        costs = PerBucketCosts(numels, all_reduce, *halves)
        buckets = [[n - 1 - b] for b in range(n)]
        timings = Timings(forward, backward, [all_reduce, [math.inf] * n])
        ddp = plan_seconds(no_delay_plan([Item(b, 0, numels[b]) for b in range(n)]), timings, numels)
        assert ddp == pytest.approx(simulated_wfbp(workload, costs, 2, buckets).iteration_s)
        assert dear_seconds(forward, backward, [halves[0]], [halves[1]]) == pytest.approx(
            simulated_dear(workload, costs, 2, buckets).iteration_s)


def test_dear_is_chosen_only_when_clearly_faster():
    # one bucket: nothing for DeAR to overlap, its two halves cost more than the all-reduce
    assert dear_seconds(1.0, [1.0], [[0.6]], [[0.6]]) == pytest.approx(3.2)
    assert plan_seconds(no_delay_plan([Item(0, 0, 10)]), Timings(1.0, [1.0], [[1.0], [math.inf]]), [10]) == pytest.approx(3.0)
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
    assert fast.predicted["dear_ms"] < fast.predicted["plan_ms"]
    delayed = plan_for(numels, timings, 0.5)
    assert delayed.delayed and not delayed.is_ddp
    assert choose_schedule(delayed, timings, numels, "when_faster", None).runs == "plan"
    assert choose_schedule(delayed, timings, numels, "when_undelayed", fast_halves).runs == "plan"


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


# ---------------------------------------------------------------- real runs


def test_deft_without_delay_equals_ddp(cases):
    results = cases(2)
    for case, reference in (("deft-sgd", "ddp-sgd"), ("deft-adamw", "ddp-adamw"), ("deft-value", "ddp-value")):
        diff, key = max_abs_diff(results.load(reference)["state"], results.load(case)["state"])
        assert diff <= 1e-5, f"{case} vs {reference}: {diff} at {key}"
        ranks = results.all_ranks(case)
        assert per_link(ranks[0]["trace"]) == per_link(ranks[1]["trace"])
        # the plan's own replay ran every step (fallback="never": no hand-over), its sends tagged g<gen>.b<bucket>
        sends = [record for record in ranks[0]["trace"] if GRADIENT_TAG.match(record[2])]
        assert len(sends) >= ranks[0]["global_step"], f"{case}: {len(sends)} sends in {ranks[0]['global_step']} steps"
        assert not any(record[2].startswith("bucket") for record in ranks[0]["trace"]), f"{case}: handed to WFBP"


GRADIENT_TAG = re.compile(r"g\d+\.b\d+")


def test_an_undelayed_plan_over_both_links_equals_sync_sgd(deft_runs):
    """Gradients themselves cross the secondary (not only the timing all-reduces), and nothing is delayed."""
    result = deft_runs("undelayed-two-links")
    plan = DeFTPlan.from_json(result["plan"])
    assert not plan.delayed
    sent = [record for record in per_link(result["trace"]).get("secondary", []) if GRADIENT_TAG.match(record[2])]
    assert sent, "no gradient crossed the secondary link"
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5


def test_deft_keeps_replicas_identical_when_parameters_are_unfrozen(cases):
    results = cases(3)
    ranks = results.all_ranks("deft-unfreeze")
    for other in ranks[1:]:
        assert max_abs_diff(ranks[0]["state"], other["state"])[0] == 0.0
    assert max_abs_diff(ranks[0]["state"], results.load("wfbp-unfreeze")["state"])[0] <= 1e-5


@pytest.fixture(scope="module")
def deft_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deft")
    proc = run_worker("run_deft.py", str(out), "2", "forced-sgd", "forced-adamw", "forced-sgd-part", "forced-sgd-resumed",
                      "forced-spike", "forced-spike-part", "forced-spike-resumed", "forced-predict", "forced-both",
                      "forced-both-part", "forced-both-resumed", "preserved", "preserved-stale",
                      "rechecked", "profiled", "handed-sgd", "handed-sgd-part", "handed-sgd-resumed", "handed-two-links",
                      "handed-wfbp", "confirmed-dear", "undelayed-two-links")
    if proc.returncode != 0:
        pytest.fail(f"deft runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    load = lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.out = out
    return load


def replay(result: dict, compensation: str = "none") -> dict:
    """One process, every rank's gradient recomputed: the plan's merges, staleness and steps. With
    compensation "spike", SGD's step is written out here: a generation D optimizer steps late (steps
    taken since its newest gradient) moves the weights by lr (v + a d) with v <- m v + b d, d its gradient
    plus weight decay, a = (1 - m^D) / (1 - m), b = m^D. With "predict", each planned iteration's
    gradients are taken at w + D (w - w_before_last_step), D the optimizer steps until its generation
    steps; "spike+predict": both."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data, make_optimizer

    world, model = result["world"], MLP(result["optimizer"])
    model.load_state_dict(result["initial"])
    configured = make_optimizer(result["optimizer"], model.parameters())
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    x, y = data().tensors
    params = list(model.parameters())
    plan = DeFTPlan.from_json(result["plan"])

    # Lightning's DistributedSampler for training: shuffled, seeded by seed_everything, epoch 0
    shares = []
    for r in range(world):
        sampler = DistributedSampler(data(), num_replicas=world, rank=r, shuffle=True, seed=result["seed"])
        sampler.set_epoch(0)
        shares.append(list(sampler))

    def averaged_gradient(t: int) -> list[torch.Tensor]:
        total = [torch.zeros_like(p) for p in params]
        for r in range(world):
            idx = shares[r][t * BATCH:(t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
            total = [a + g / world for a, g in zip(total, grads)]
        return total

    velocity: dict[int, torch.Tensor] = {}
    taken = 0  # optimizer steps so far
    joined_at: dict[int, int] = {}
    before_last_step = [p.detach().clone() for p in params]

    # every optimizer step of the plan in order (iteration, generation): how late each iteration's gradient lands
    events = [(i, number) for i in range(result["steps"] + 2 * plan.n + 8) for number in plan.at(i).steps]

    def late_by(i: int) -> int:
        applied = next(e for e, (_, number) in enumerate(events) if number == plan.at(i).joins)
        return applied - sum(1 for j, _ in events if j < i)

    @torch.no_grad()
    def spike(gradient: list[torch.Tensor], late: int) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        for group in optimizer.param_groups:
            m, decay, lr = group["momentum"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                i = index[id(p)]
                d = gradient[i] + decay * p
                if m == 0:
                    p.sub_(lr * d)
                    continue
                a, b = (1 - m ** late) / (1 - m), m ** late
                velocity[i] = b * d if i not in velocity else m * velocity[i] + b * d
                p.sub_(lr * (velocity[i] + a * d))

    def step(gradient: list[torch.Tensor], late: int = 0) -> None:
        nonlocal taken, before_last_step
        before_last_step = [p.detach().clone() for p in params]
        if compensation.startswith("spike"):
            spike(gradient, late)
            optimizer._opt_called = True  # the step is written out here: the scheduler must not warn
        else:
            for p, g in zip(params, gradient):
                p.grad = g.clone()
            optimizer.step()
        taken += 1

    generations: dict[int, list] = {}
    for t in range(result["steps"]):
        now = [p.detach().clone() for p in params]
        if compensation.endswith("predict") and t >= result["sync_steps"]:  # linear weight prediction
            with torch.no_grad():
                for p, w, before in zip(params, now, before_last_step):
                    p.copy_(w + late_by(t - result["sync_steps"]) * (w - before))
        gradient = averaged_gradient(t)
        with torch.no_grad():
            for p, w in zip(params, now):
                p.copy_(w)
        if t < result["sync_steps"]:
            step(gradient)
            scheduler.step()
            continue
        it = plan.at(t - result["sync_steps"])
        summed, k = generations.get(it.joins, ([torch.zeros_like(p) for p in params], 0))
        generations[it.joins] = ([a + g for a, g in zip(summed, gradient)], k + 1)
        joined_at[it.joins] = taken
        for number in it.steps:
            summed, k = generations.pop(number)
            step([g / k for g in summed], taken - joined_at[number])
            scheduler.step()
    for number in sorted(generations):  # the end of training applies what is left
        summed, k = generations.pop(number)
        step([g / k for g in summed], taken - joined_at[number])
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["forced-sgd", "forced-adamw"])
def test_forced_delays_equal_a_single_process_replay(deft_runs, case):
    result = deft_runs(case)
    plan = DeFTPlan.from_json(result["plan"])
    assert plan.delayed and max(plan.k) > 1, plan.describe()
    expected = replay(result)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    other = deft_runs(case, 1)
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    assert {"primary", "secondary"} <= set(per_link(result["trace"]))


def test_spike_compensated_delays_equal_a_single_process_replay(deft_runs):
    """compensation="spike", two param groups with their own momentum and decay: the product equals
    the replay's written-out compensated SGD, not the uncompensated trajectory."""
    result = deft_runs("forced-spike")
    plan = DeFTPlan.from_json(result["plan"])
    assert plan.delayed and max(plan.k) > 1, plan.describe()
    diff, key = max_abs_diff(replay(result, compensation="spike"), result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(replay(result), result["state"])[0] > 1e-3
    assert max_abs_diff(result["state"], deft_runs("forced-spike", 1)["state"])[0] == 0.0


@pytest.mark.parametrize("case, compensation", [("forced-predict", "predict"), ("forced-both", "spike+predict")])
def test_predicted_weights_equal_a_single_process_replay(deft_runs, case, compensation):
    """Linear weight prediction under AdamW, and with spike compensation under SGD: the product equals
    the replay's gradients taken at the extrapolated weights, not the trajectory without them."""
    result = deft_runs(case)
    diff, key = max_abs_diff(replay(result, compensation=compensation), result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    without = compensation.removesuffix("predict").removesuffix("+") or "none"
    assert max_abs_diff(replay(result, compensation=without), result["state"])[0] > 1e-3
    assert max_abs_diff(result["state"], deft_runs(case, 1)["state"])[0] == 0.0


@pytest.mark.parametrize("case", ["forced-spike", "forced-both"])
def test_resumed_with_compensated_generations_in_flight_equals_uninterrupted(deft_runs, case):
    for rank in (0, 1):
        whole, resumed = deft_runs(case, rank), deft_runs(f"{case}-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] <= 1e-6


def test_resumed_with_delayed_gradients_equals_uninterrupted(deft_runs):
    for rank in (0, 1):
        whole, resumed = deft_runs("forced-sgd", rank), deft_runs("forced-sgd-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] <= 1e-6


def test_an_undelayed_plan_handed_to_dear_equals_sync_sgd_and_resumes_exactly(deft_runs):
    """dear_fallback="when_undelayed": after the measured steps DeAR's hooks run the iterations."""
    result, other = deft_runs("handed-sgd"), deft_runs("handed-sgd", 1)
    assert result["report"]["runs"] == "dear" and not DeFTPlan.from_json(result["plan"]).delayed
    assert set(result["report"]["predicted"]) == {"plan_ms", "dear_ms"}
    collectives = {(link, collective) for link, collective, *_ in result["trace"]}
    assert {("primary", "reduce_scatter"), ("primary", "all_gather")} <= collectives
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    for rank in (0, 1):
        resumed = deft_runs("handed-sgd-resumed", rank)
        assert resumed["report"]["runs"] == "dear"
        assert max_abs_diff(deft_runs("handed-sgd", rank)["state"], resumed["state"])[0] <= 1e-6


def test_dear_over_both_links_equals_sync_training(deft_runs):
    """Halves from the timings file: DeAR over both links is predicted fastest and runs, exactly."""
    result, other = deft_runs("handed-two-links"), deft_runs("handed-two-links", 1)
    assert result["report"]["runs"] == "dear" and set(result["report"]["dear_links"]) == {"primary", "secondary"}
    collectives = {(link, collective) for link, collective, *_ in result["trace"]}
    assert {(link, op) for link in ("primary", "secondary") for op in ("reduce_scatter", "all_gather")} <= collectives
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_ddps_schedule_is_handed_to_wfbp_when_dear_is_slower(deft_runs):
    """A callback reads the weights every step: DeAR is still considered (it is exact under any callback)
    and, predicted slower here, DDP's schedule goes to WFBP."""
    result, other = deft_runs("handed-wfbp"), deft_runs("handed-wfbp", 1)
    assert result["report"]["runs"] == "wfbp"
    assert result["report"]["predicted"]["dear_ms"] > result["report"]["predicted"]["plan_ms"]
    after_decision = [op for link, op, tag, *_ in result["trace"] if link == "primary" and tag.startswith("bucket")]
    assert after_decision and set(after_decision) == {"all_reduce"}
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_real_steps_overrule_a_wrong_prediction(deft_runs):
    """Predicted slower, DeAR is timed on real steps against WFBP, whose steps a callback slows down by
    0.3 s: the measurement wins, every rank agrees, and the switches keep training exact."""
    result, other = deft_runs("confirmed-dear"), deft_runs("confirmed-dear", 1)
    report = result["report"]
    assert report["predicted"]["dear_ms"] > report["predicted"]["plan_ms"]
    assert report["runs"] == "dear" and report == other["report"]
    assert report["measured"]["wfbp"] > report["measured"]["dear"] + 250, report["measured"]
    reduce_scatters = [tag for link, op, tag, *_ in result["trace"] if op == "reduce_scatter"]
    assert reduce_scatters, "DeAR never ran"
    assert max_abs_diff(replay(result), result["state"])[0] <= 1e-5
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])


def test_preserver_decides_and_logs_every_decision(deft_runs):
    decisions = deft_runs("preserved")["decisions"]
    assert decisions and decisions[-1]["accepted"]
    for d in decisions:
        assert set(d) >= {"ratio", "k", "capacity", "accepted"}
    for earlier, later in zip(decisions, decisions[1:]):
        assert not earlier["accepted"]
        assert later["capacity"] is None or later["capacity"] > earlier["capacity"]
    accepted = decisions[-1]
    assert accepted["capacity"] is None or abs(accepted["ratio"] - 1) <= 0.01
    assert accepted["staleness"] == 0  # the default max_staleness
    # The forced timings make the first plan (capacity 1.0, as forced-sgd runs it) delay: the guard
    # must reject it, for a reason it states, before it accepts a larger capacity.
    first = decisions[0]
    assert len(decisions) >= 2 and not first["accepted"] and first["capacity"] == 1.0
    assert abs(first["ratio"] - 1) > 0.01 or first["staleness"] > 0


def test_preserver_judges_stale_plans_by_the_measured_curvature(deft_runs):
    """max_staleness=1: a stale plan is accepted only while the optimizer with that staleness stays
    stable on the top curvature measured on the probe steps (agreed by every rank)."""
    runs = [deft_runs("preserved-stale", r) for r in (0, 1)]
    ranks = [run["decisions"] for run in runs]  # rank 0 solves, every rank replays what it broadcast
    stale = [d for d in ranks[0] if d["staleness"] == 1]
    assert stale, "the forced timings make the first plans stale"
    for d in stale:
        assert d["curvature"] > 0 and d["stable_below"] > 0 and d["margin"] == 1.0
        assert d["accepted"] == (abs(d["ratio"] - 1) <= 0.01 and d["curvature"] < d["stable_below"])
    # the band is the optimizer's as it is at the decision (SGD, momentum 0.9, lr 0.2 decaying by 1/(1 + 0.05 step)):
    # (1 - m) / lr
    assert largest_stable_curvature(Stepper(0.2, 0.9), 1) <= stale[0]["stable_below"] <= largest_stable_curvature(Stepper(0.15, 0.9), 1)
    assert [d for d in ranks[0] if d["staleness"] > 1 and d["accepted"]] == []
    assert runs[0]["plan"] == runs[1]["plan"] and max_abs_diff(runs[0]["state"], runs[1]["state"])[0] == 0.0


def test_preserver_rechecks_and_the_engine_solves_again(deft_runs):
    ranks = [deft_runs("rechecked", r) for r in (0, 1)]
    decisions = ranks[0]["decisions"]
    assert sum(d["accepted"] for d in decisions) == 2  # at the start, and again at step 8
    assert max_abs_diff(ranks[0]["state"], ranks[1]["state"])[0] == 0.0
    assert per_link(ranks[0]["trace"]) == per_link(ranks[1]["trace"])


def test_profiled_run_traces_one_lane_per_link(deft_runs):
    trace = json.loads((deft_runs.out / "profiled-profile" / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"link: primary", "link: secondary"} <= lanes
    busy = {e["tid"] for e in events if e.get("ph") == "X" and e["name"].startswith("all_reduce g")}
    assert len(busy) >= 2  # delayed generations went over both links while profiled


def test_when_everything_fits_both_links_share_the_work():
    """The paper's smallest-knapsack-first rule would put every item on the slower link here."""
    primary = [1.0] * 8
    weights, capacities = [primary, [1.6] * 8], [20.0, 20.0]
    for assignment in (multi_knapsack_greedy(weights, capacities, primary), multi_knapsack_exact(weights[:], capacities, primary)):
        assert len(assignment.chosen()) == 8
        assert assignment.chosen(0) and assignment.chosen(1)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-nesterov"])
def test_spike_compensation_is_refused_where_it_does_not_stand_in_for_the_momentum(optimizer, tmp_path):
    import commsched
    import lightning.pytorch as pl

    sys.path.insert(0, str(WORKERS))
    from run_deft import MLP

    strategy = commsched.DeFTStrategy(deft=commsched.DeFTOptions(compensation="spike"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    environment = dict(os.environ)
    try:
        with pytest.raises(commsched.CommSchedConfigError, match=r"compensation='spike'.*(AdamW|SGD).*Allowed values of compensation: none, spike"):
            trainer.fit(MLP(optimizer))
    finally:  # the one-process group holds MASTER_PORT, which every later worker of the suite would inherit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


def test_weight_prediction_extrapolates_the_last_update_restores_exactly_and_forgets():
    from commsched.deft.prediction import WeightPrediction

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
