"""Sparse exchanges: MSTopK against torch.topk, and wfbp with top-k against a single-process reference
of the exchange (every rank's selection, residual and the sum of what was sent), written apart from
the engine."""

from __future__ import annotations

import math
import re
import sys
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import commsched
from commsched.compression import mstopk, sampled_topk
from conftest import WORKERS, max_abs_diff, per_link, run_worker


# ------------------------------------------------------------------ MSTopK
def heavy_tailed(d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(d, generator=g) / torch.rand(d, generator=g).clamp_min(1e-3)


@pytest.mark.parametrize("d, density", [(1000, 0.01), (100_000, 0.01), (100_000, 0.001), (1_000_000, 0.001), (4096, 0.5)])
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


@pytest.mark.parametrize("x, k", [
    (torch.ones(100), 7),  # every element ties
    (torch.zeros(100), 7),  # nothing to choose between
    (torch.cat([torch.full((20,), 5.0), torch.randn(80)]), 7),  # more than k tie at the maximum: no threshold keeps <= k
    (torch.randn(50), 50),  # k = d
    (torch.randn(50), 0),  # k = 0
    (torch.tensor([3.0, -3.0, 1.0, -1.0, 0.5]), 3),  # signs: magnitude counts
])
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
@pytest.mark.parametrize("d, density", [(1000, 0.01), (100_000, 0.01), (100_000, 0.001), (1_000_000, 0.001), (4096, 0.5), (50, 0.3)])
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
    assert torch.equal(sampled_topk(sparse, 1000)[0].abs().sort().values, torch.topk(sparse.abs(), 1000).values.sort().values)
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
    assert [warmup.density(step) for step in (0, 3, 6, 7, 11, 15, 18, 19, 100)] == [0.01, 1.0, 1.0, 0.25, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    assert warmup.end == 19


def test_one_dimensional_parameters_are_sent_whole_beside_the_top_k_of_the_rest():
    """Brute force over every window a rank selects in (the whole bucket, each half-shard): the 1-d
    parameters' positions all go, and the k largest magnitudes among the other positions."""
    from commsched.buckets import Bucket
    from commsched.compression.whole_vectors import WholeVectors
    from commsched.reducers.topk import exact_topk

    shapes = [(6, 5), (5,), (4, 3, 2), (7,), (3,), (10, 2)]  # 89 elements, padded to 90
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    buffer = torch.zeros(90)
    buffer[:89] = torch.randn(89, generator=torch.Generator().manual_seed(3))
    bucket = Bucket(0, [f"p{i}" for i in range(len(params))], params, buffer, [], 89, 45)
    is_vector = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in params] + [torch.tensor([False])])
    for start, length in [(0, 90), (0, 45), (45, 45)]:
        x = buffer[start:start + length]
        vectors = is_vector[start:start + length].nonzero().flatten().tolist()
        ranked = (~is_vector[start:start + length]).nonzero().flatten()
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
    with pytest.raises(commsched.CommSchedConfigError, match=r"WFBPStrategy\(compression='gzip'\); allowed: one of 'none', 'auto', 'topk', 'sampled', 'mstopk'"):
        commsched.WFBPStrategy(compression="gzip")
    with pytest.raises(commsched.CommSchedConfigError, match=r"CompressionOptions\(method='mstopk'\).*schedule dear"):
        commsched.DeARStrategy(compression="mstopk")
    with pytest.raises(commsched.CommSchedConfigError, match=r"CompressionOptions\(sparsity_warmup_steps=-1\); allowed: an integer >= 0 or \"auto\""):
        commsched.WFBPStrategy(compression=commsched.CompressionOptions(method="topk", sparsity_warmup_steps=-1))
    with pytest.raises(commsched.CommSchedConfigError, match=r"CompressionOptions\(samplings=0\)"):
        commsched.WFBPStrategy(compression=commsched.CompressionOptions(method="mstopk", samplings=0))


# ------------------------------------------------------------ exchanges
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression")
    proc = run_worker("run_compression.py", str(out), "2", "topk", "topk-part", "topk-resumed", "topk-no-feedback", "topk-auto",
                      "mstopk", "topk-dense-phases", "mstopk-whole", "dense", "dense-from-topk", "topk-every-element",
                      "dgc", "dgc-part", "dgc-resumed", "dgc-nesterov", "dgc-clipped", "dgc-masked", "dgc-warmup",
                      "dense-from-dgc", "adamw-default", "adamw-plain")
    if proc.returncode != 0:
        pytest.fail(f"compression runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    alone = run_worker("run_compression.py", str(out), "3", "topk-resharded", "dgc-resharded")
    if alone.returncode != 0:
        pytest.fail(f"the three-process resume failed:\n{alone.stdout[-3000:]}\n{alone.stderr[-6000:]}")
    load = lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.said = proc.stdout + proc.stderr + alone.stdout + alone.stderr
    return load


def step_with(params: list, total: torch.Tensor, optimizer, scheduler) -> None:
    """The reference's update: each parameter's slice of the summed flat gradient, then one step."""
    offset = 0
    for p in params:
        p.grad = total[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optimizer.step()
    scheduler.step()


def sent_whole_and_ranked(vector: torch.Tensor, real: torch.Tensor, compression: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Of a window whose 1-d parameters' positions are `vector` and whose parameters' (not padding)
    are `real`: the positions always sent, those ranked, and k, the density's share of the ranked
    ones (at least one)."""
    if not compression.get("whole_vectors", True):
        vector = torch.zeros_like(vector)
    ranked = (~vector & real).nonzero().flatten()
    return vector.nonzero().flatten(), ranked, min(ranked.numel(), max(1, math.ceil(compression["density"] * ranked.numel())))


def rank_shares(dataset, world: int, seed: int) -> list[list[int]]:
    """Each rank's sample indices of epoch 0, as Lightning's DistributedSampler hands them out."""
    shares = []
    for r in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        shares.append(list(sampler))
    return shares


def reference(result: dict, dense_steps: Optional[set[int]] = None) -> tuple[dict, list[torch.Tensor]]:
    """One process: each rank's gradient / P plus its residual; every element of the 1-d parameters
    and the k largest magnitudes among the others sent, the rest kept; the sum of what every rank
    sent is the step's gradient. Returns the final weights and
    each rank's final residual (the whole model's gradient as one vector: a single bucket)."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data, make_optimizer

    world, compression = result["world"], result["compression"]
    model = MLP("sgd")
    model.load_state_dict(result["initial"])
    configured = make_optimizer("sgd", model.parameters())
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    x, y = data().tensors
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    vector = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in params])
    always, ranked, k = sent_whole_and_ranked(vector, torch.ones_like(vector), compression)
    shares = rank_shares(data(), world, result["seed"])
    residuals = [torch.zeros(numel) for _ in range(world)]
    for t in range(result["steps"]):
        total = torch.zeros(numel)
        dense = t < compression.get("dense_warmup_steps", 0) or t >= result["steps"] - compression.get("dense_final_steps", 0)
        dense = dense or (dense_steps is not None and t in dense_steps)
        for r in range(world):
            idx = shares[r][t * BATCH:(t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
            mine = torch.cat([g.reshape(-1) for g in grads]) / world
            if compression["error_feedback"]:
                mine = mine + residuals[r]
            chosen = torch.arange(numel) if dense else torch.cat([always, ranked[torch.topk(mine[ranked].abs(), k).indices]])
            sent = torch.zeros(numel)
            sent[chosen] = mine[chosen]
            if compression["error_feedback"]:
                residuals[r] = mine - sent
            total += sent
        step_with(params, total, optimizer, scheduler)
    return {k: v.detach() for k, v in model.state_dict().items()}, residuals


def flat_residual(result: dict, params: list[str]) -> torch.Tensor:
    return torch.cat([result["residuals"][name].reshape(-1) for name in params])


@pytest.mark.parametrize("case", ["topk", "topk-no-feedback", "topk-dense-phases", "topk-every-element"])
def test_topk_exchange_equals_the_single_process_reference(runs, case):
    result, other = runs(case), runs(case, 1)
    expected, residuals = reference(result)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    ops = [op for link, op, tag, numel, dtype in result["trace"] if tag.startswith("bucket")]
    expected_ops = ["all_reduce"] * 3 + ["all_gather"] * 6 + ["all_reduce"] * 3 if case == "topk-dense-phases" else ["all_gather"] * 12
    assert ops == expected_ops
    if case == "topk-dense-phases":  # the residual joined the first dense step: nothing is left at the end
        assert all(t.abs().sum() == 0 for t in result["residuals"].values())
    if case == "topk":
        names = [n for n, _ in torch.nn.Module.named_parameters(__import__("run_deft").MLP("sgd"))]
        for rank, run in enumerate((result, other)):
            assert torch.allclose(flat_residual(run, names), residuals[rank], atol=1e-6)
            assert flat_residual(run, names).abs().sum() > 0
    if case == "topk-no-feedback":
        assert result["residuals"] == {}


def test_error_feedback_changes_the_result(runs):
    assert max_abs_diff(runs("topk")["state"], runs("topk-no-feedback")["state"])[0] > 1e-4


def test_a_sparse_run_without_warm_up_is_advised_once(runs):
    """The thirteen fresh sparse runs with no warm-up of either kind (12, 16 or 5 steps, shorter than their
    epoch of 256 samples / 2 ranks / batch 4 = 32 steps) are told a tenth of the run; the resumed, dense,
    warmed-up and density-1 runs are not."""
    advice = re.findall(r"no dense warm-up.*?CompressionOptions\(dense_warmup_steps=(\d+)\) \((.*?)\)", runs.said)
    assert advice == [("1", "a tenth of this run, shorter than an epoch")] * 13, advice  # and the dgc and adamw runs without warm-up


def test_the_warm_up_advice_is_one_epoch_or_a_tenth_of_a_shorter_run():
    from commsched import errors
    from commsched.schedules.wfbp import warm_up_advice

    assert warm_up_advice(32, 264) == "CompressionOptions(dense_warmup_steps=32) (one epoch here)"
    assert warm_up_advice(32, 12) == "CompressionOptions(dense_warmup_steps=1) (a tenth of this run, shorter than an epoch)"
    assert warm_up_advice(math.inf, math.inf) == "a dense warm-up (compression.dense_warmup_steps) of about one epoch"
    errors.use_syntax("hydra")  # commsched-train's workers: the command line's spelling
    try:
        assert warm_up_advice(math.inf, 500) == "compression.dense_warmup_steps=50 (a tenth of this run, shorter than an epoch)"
    finally:
        errors.use_syntax("python")


def test_density_one_equals_a_dense_all_reduce(runs):
    assert max_abs_diff(runs("mstopk-whole")["state"], runs("dense")["state"])[0] <= 1e-6


def test_mstopk_keeps_ranks_identical_and_sends_k_per_rank(runs):
    result, other = runs("mstopk"), runs("mstopk", 1)
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert max_abs_diff(result["state"], result["initial"])[0] > 1e-3  # it trained
    vectors = sum(v.numel() for v in result["initial"].values() if v.dim() == 1)
    k = math.ceil(0.05 * sum(v.numel() for v in result["initial"].values() if v.dim() > 1))
    sent = {numel_ for link, op, tag, numel_, dtype in result["trace"] if tag.startswith("bucket")}
    assert sent == {2 * (2 * k + vectors)}  # 2 ranks x (k values + k indices + the 1-d parameters' values, positions known)


def test_resumed_run_with_residuals_equals_uninterrupted(runs):
    for rank in (0, 1):
        whole, resumed = runs("topk", rank), runs("topk-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] == 0.0
        assert set(whole["residuals"]) == set(resumed["residuals"])
        for name in whole["residuals"]:
            assert torch.equal(whole["residuals"][name], resumed["residuals"][name])


def test_a_dense_run_resumed_from_a_compressed_one_applies_its_residuals(runs):
    """Steps 0-4 top-k with error feedback, then dense from the checkpoint: what the ranks still owed
    joins step 5's gradient, as the reference's dense phase does."""
    resumed = runs("dense-from-topk")
    assert "refused" not in resumed
    expected, _ = reference({**resumed, "compression": {"density": 0.1, "error_feedback": True, "dense_final_steps": 7}})
    assert max_abs_diff(expected, resumed["state"])[0] <= 1e-5
    dropped, _ = reference({**resumed, "compression": {"density": 0.1, "error_feedback": False, "dense_final_steps": 7}})
    assert max_abs_diff(dropped, resumed["state"])[0] > 1e-4  # the residuals mattered
    assert "residuals join the first step's gradient" in runs.said


def test_a_resume_at_another_world_size_keeps_the_residuals_sum(runs):
    """Written by 2 processes, resumed by 3 (no step taken): each new rank holds a third of the sum."""
    parts = [runs("topk-part", rank)["residuals"] for rank in (0, 1)]
    now = [runs("topk-resharded", rank)["residuals"] for rank in (0, 1, 2)]
    assert set(now[0]) == set(parts[0])
    for name in parts[0]:
        owed = parts[0][name] + parts[1][name]
        assert (owed.abs().sum() > 0) == (owed.dim() > 1)  # 1-d parameters are sent whole: nothing owed
        assert torch.allclose(now[0][name] + now[1][name] + now[2][name], owed, atol=1e-6)
        assert torch.allclose(now[2][name], owed / 3, atol=1e-7)
    assert "re-sharded over 3" in runs.said


# ------------------------------------------------------- two-level (HiTopKComm) on 2 nodes x 2 workers
from commsched import netns  # noqa: E402

needs_root = pytest.mark.skipif(netns.unavailable_reason() is not None, reason=f"no emulated cluster here: {netns.unavailable_reason()}")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    import subprocess
    from pathlib import Path

    out = tmp_path_factory.mktemp("hierarchical")
    command = [str(Path(sys.executable).parent / "commsched-cluster"), "--nodes", "2", "--workers-per-node", "2", "--rate", "1gbit",
               "--", sys.executable, str(WORKERS / "run_hierarchical.py"), str(out), "2", "2",
               "flat-dense", "hier-dense", "hier-topk", "hier-mstopk", "hier-topk-phases", "hier-dense-streams", "auto-two-level",
               "hier-dgc"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=WORKERS)
    if proc.returncode != 0:
        pytest.fail(f"two-node runs failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}")
    return lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)


def hierarchical_reference(result: dict) -> tuple[dict, list[torch.Tensor]]:
    """One process, 4 ranks on 2 nodes: each node sums its ranks' gradients / P per shard (the shard
    of local rank j is the j-th half of the padded bucket), adds that rank's residual, sends the
    shard's 1-d parameter elements and its k largest magnitudes among the others; the shards' sums
    over nodes make the step's gradient."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data, make_optimizer

    world, nodes, compression = result["world"], result["nodes"], result["compression"]
    per_node = world // nodes
    names, padded, buckets = result["layout"]
    assert buckets == 1
    model = MLP("sgd")
    model.load_state_dict(result["initial"])
    configured = make_optimizer("sgd", model.parameters())
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    by_name = dict(model.named_parameters())
    ordered = [by_name[n] for n in names]
    x, y = data().tensors
    shares = rank_shares(data(), world, result["seed"])
    shard = padded // per_node
    vector = torch.zeros(padded, dtype=torch.bool)
    vector[:sum(p.numel() for p in ordered)] = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in ordered])
    real = torch.arange(padded) < sum(p.numel() for p in ordered)
    windows = [sent_whole_and_ranked(vector[j * shard:(j + 1) * shard], real[j * shard:(j + 1) * shard], compression)
               for j in range(per_node)]
    residuals = [torch.zeros(shard) for _ in range(world)]
    for t in range(result["steps"]):
        dense = t < compression["dense_warmup_steps"] or t >= result["steps"] - compression["dense_final_steps"]
        flats = []
        for r in range(world):
            idx = shares[r][t * BATCH:(t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), ordered)
            flat = torch.zeros(padded)
            flat[:sum(p.numel() for p in ordered)] = torch.cat([g.reshape(-1) for g in grads]) / world
            flats.append(flat)
        total = torch.zeros(padded)
        for node in range(nodes):
            for j in range(per_node):
                part = sum(flats[node * per_node + l][j * shard:(j + 1) * shard] for l in range(per_node))
                rank = node * per_node + j
                part = part + residuals[rank]
                always, ranked, k = windows[j]
                chosen = torch.arange(shard) if dense else torch.cat([always, ranked[torch.topk(part[ranked].abs(), k).indices]])
                sent = torch.zeros(shard)
                sent[chosen] = part[chosen]
                residuals[rank] = part - sent
                total[j * shard:(j + 1) * shard] += sent
        step_with(ordered, total, optimizer, scheduler)
    return {k: v.detach() for k, v in model.state_dict().items()}, residuals


@needs_root
def test_the_step_timer_tells_node_local_bytes_from_the_rest(two_nodes):
    """The dense two-level all-reduce of a B-byte bucket on 2 nodes x 2: inside the node a ring
    reduce-scatter and all-gather each send B / 2 (node-local: B); across nodes the all-reduce of the
    B / 2 shard between 2 sends B / 2, beside a few values of the step's own bookkeeping (which
    parameters got gradients). The flat all-reduce has no node-local link."""
    _, padded, _ = two_nodes("hier-dense")["layout"]
    bucket = 4 * padded
    for rank in range(4):
        hier, flat = two_nodes("hier-dense", rank), two_nodes("flat-dense", rank)
        assert hier["local_bytes"] and set(hier["local_bytes"]) == {bucket}
        assert all(bucket / 2 <= wire - bucket <= bucket / 2 + 64 for wire in hier["wire_bytes"])
        assert set(flat["local_bytes"]) == {0.0} and flat["wire_bytes"][0] > 0


@needs_root
def test_the_dense_two_level_all_reduce_equals_the_flat_one(two_nodes):
    for rank in range(4):
        assert max_abs_diff(two_nodes("hier-dense", rank)["state"], two_nodes("flat-dense", rank)["state"])[0] <= 1e-5
    ops = {(link, op) for link, op, tag, *_ in two_nodes("hier-dense")["trace"] if tag.startswith("bucket")}
    assert ops == {("intra", "reduce_scatter"), ("inter", "all_reduce"), ("intra", "all_gather")}


@needs_root
@pytest.mark.parametrize("case", ["hier-topk", "hier-topk-phases"])
def test_hitopkcomm_equals_the_single_process_reference(two_nodes, case):
    result = two_nodes(case)
    expected, residuals = hierarchical_reference(result)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    names, padded, _ = result["layout"]
    for rank in range(4):
        mine = two_nodes(case, rank)
        assert max_abs_diff(mine["state"], result["state"])[0] == 0.0
        # "inter" is one group per local rank: equal within it; the shards' 1-d elements differ between them
        assert per_link(mine["trace"]) == per_link(two_nodes(case, rank % 2)["trace"])
        assert {link: [r[:3] for r in records] for link, records in per_link(mine["trace"]).items()} == \
            {link: [r[:3] for r in records] for link, records in per_link(result["trace"]).items()}
        whole = torch.zeros(padded)
        whole[:sum(mine["residuals"][n].numel() for n in names)] = torch.cat([mine["residuals"][n].reshape(-1) for n in names])
        local = rank % 2
        assert torch.allclose(whole.view(2, -1)[local], residuals[rank], atol=1e-6)
        assert whole.view(2, -1)[1 - local].abs().sum() == 0  # a rank keeps the residual of its own shard only
    across = [op for link, op, tag, *_ in result["trace"] if tag.startswith("bucket") and link == "inter"]
    assert across == (["all_reduce"] * 2 + ["all_gather"] * 5 + ["all_reduce"] * 3 if case == "hier-topk-phases" else ["all_gather"] * 10)


@needs_root
def test_hierarchical_mstopk_keeps_every_rank_identical(two_nodes):
    first = two_nodes("hier-mstopk")
    assert max_abs_diff(first["state"], first["initial"])[0] > 1e-3
    for rank in range(1, 4):
        assert max_abs_diff(two_nodes("hier-mstopk", rank)["state"], first["state"])[0] == 0.0


@needs_root
def test_two_levels_on_several_streams_and_their_search_equal_the_flat_all_reduce(two_nodes):
    """2 nodes x 2 workers: node first on 2 streams (each unit on its stream's intra and inter groups),
    and `streams="auto"` trying flat and node first, give the flat all-reduce's weights on every rank."""
    for case in ("hier-dense-streams", "auto-two-level"):
        for rank in range(4):
            assert max_abs_diff(two_nodes(case, rank)["state"], two_nodes("flat-dense", rank)["state"])[0] <= 1e-5, (case, rank)
            assert per_link(two_nodes(case, rank)["trace"]) == per_link(two_nodes(case, 0)["trace"]), (case, rank)
    links = {link for link, *_ in two_nodes("hier-dense-streams")["trace"]}
    assert {"intra", "intra.1", "inter", "inter.1"} <= links
    trials = two_nodes("auto-two-level")["trials"]
    assert {t["hierarchical"] for t in trials} == {False, True} and trials[0]["streams"] == trials[1]["streams"] == 1
    assert len({str(two_nodes("auto-two-level", rank)["chosen"]) for rank in range(4)}) == 1


def test_topk_by_default_takes_turns_with_dense_and_keeps_the_faster_exactly(runs):
    """strategy="topk"'s default (method "auto"): after 5 steps, dense and sparse exchanges take turns
    (2 rounds of a switch step and a timed one each), then the faster is kept on every rank alike. Which
    is faster is the machine's to say; the arithmetic is not: the run equals the single-process reference
    exchanging dense on exactly the steps it did, each rank's residual joining the first dense step."""
    result, other = runs("topk-auto"), runs("topk-auto", 1)
    assert result["selection"]["method"] == "topk"  # torch.topk, ~10x faster than MSTopK on every CPU measured
    ops = [op for link, op, tag, numel, dtype in result["trace"] if tag.startswith("bucket")]
    assert len(ops) == 16 and set(ops) <= {"all_reduce", "all_gather"}
    turns = ["all_reduce"] * 2 + ["all_gather"] * 2
    assert ops[:5] == ["all_gather"] * 5 and ops[5:13] == turns * 2, ops
    assert ops[13:] == ["all_gather" if result["kept"] else "all_reduce"] * 3
    assert other["kept"] == result["kept"] and per_link(result["trace"]) == per_link(other["trace"])
    expected, _ = reference(result, dense_steps={t for t, op in enumerate(ops) if op == "all_reduce"})
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0


# ------------------------------------------------------- DGC's corrections (the defaults under SGD)
def sgd_terms(optimizer: str, param: torch.Tensor) -> tuple[float, bool, float]:
    """(momentum, nesterov, weight decay) that run_deft's "sgd-groups"/"sgd-nesterov" give a parameter:
    weights momentum 0.9 and decay 0.05, biases momentum 0.5 and no decay."""
    return (0.9, optimizer == "sgd-nesterov", 0.05) if param.dim() > 1 else (0.5, optimizer == "sgd-nesterov", 0.0)


def dgc_reference(result: dict, densities: Optional[list[float]] = None, masking: bool = False) -> tuple[dict, list, list]:
    """One process, written from DGC's text: each rank clips each parameter's gradient to C / sqrt(P),
    adds weight decay, updates its velocity u (Nesterov: u <- m (u + g), u + g accumulated), accumulates
    v, sends the 1-d parameters and the k largest |v| among the rest, clears v where sent (and, with
    `masking`, u where selected); a dense step sends all of v and keeps u. The optimizer is plain SGD (no momentum, no
    decay) at the run's learning rate. Returns final weights, each rank's v and u (flat)."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data

    world, compression, steps = result["world"], result["compression"], result["steps"]
    model = MLP(result["optimizer"])
    model.load_state_dict(result["initial"])
    params = list(model.parameters())
    terms = [sgd_terms(result["optimizer"], p) for p in params]
    x, y = data().tensors
    numel = sum(p.numel() for p in params)
    vector = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in params])
    always, ranked, _ = sent_whole_and_ranked(vector, torch.ones_like(vector), compression)
    shares = rank_shares(data(), world, result["seed"])
    v = [torch.zeros(numel) for _ in range(world)]
    u = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    for t in range(steps):
        density = densities[t] if densities else compression["density"]
        dense = density >= 1 / world
        k = min(ranked.numel(), max(1, math.ceil(density * ranked.numel())))
        total = torch.zeros(numel)
        for r in range(world):
            idx = shares[r][t * BATCH:(t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
            pieces = []
            for i, (p, grad, (m, nesterov, decay)) in enumerate(zip(params, grads, terms)):
                g = grad / world
                if result["clip"]:
                    g = g * min(1.0, (result["clip"] / math.sqrt(world)) / (grad.norm().item() + 1e-6))
                g = g + decay * p.detach() / world
                if nesterov:
                    u[r][i] = m * (u[r][i] + g)
                    pieces.append(u[r][i] + g)
                else:
                    u[r][i] = m * u[r][i] + g
                    pieces.append(u[r][i].clone())
            v[r] = v[r] + torch.cat([piece.reshape(-1) for piece in pieces])
            if dense:
                total += v[r]
                v[r] = torch.zeros(numel)
                continue
            top = ranked[torch.topk(v[r][ranked].abs(), k).indices]
            chosen = torch.cat([always, top])
            total[chosen] += v[r][chosen]
            v[r][chosen] = 0.0
            if masking:
                flat_u = torch.cat([piece.reshape(-1) for piece in u[r]])
                flat_u[top] = 0.0
                u[r] = [piece.view_as(p) for piece, p in zip(flat_u.split([p.numel() for p in params]), params)]
        lr = 0.2 / (1.0 + 0.05 * t)  # run_deft's LambdaLR
        with torch.no_grad():
            for p, piece in zip(params, total.split([p.numel() for p in params])):
                p -= lr * piece.view_as(p)
    return ({k: v_.detach() for k, v_ in model.state_dict().items()}, v,
            [torch.cat([piece.reshape(-1) for piece in ur]) for ur in u])


def flat_state(result: dict, key: str) -> torch.Tensor:
    names = [n for n, _ in __import__("run_deft").MLP("sgd").named_parameters()]
    return torch.cat([result[key][name].reshape(-1) for name in names])


@pytest.mark.parametrize("case", ["dgc", "dgc-nesterov", "dgc-clipped", "dgc-masked", "dgc-warmup"])
def test_dgc_corrections_equal_the_single_process_reference(runs, case):
    """Momentum correction, masking, weight decay before accumulation, local clipping and the density's
    warm-up, under two param groups with their own momentum and decay: the 2-process run equals the
    reference written from DGC's description, weights, residuals and velocities of both ranks."""
    result, other = runs(case), runs(case, 1)
    densities = [1.0] * 4 + [0.25] * 4 + [0.1] * 4 if case == "dgc-warmup" else None
    expected, residuals, velocities = dgc_reference(result, densities, masking=case == "dgc-masked")
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    for rank, run in enumerate((result, other)):
        assert torch.allclose(flat_state(run, "residuals"), residuals[rank], atol=1e-6), rank
        assert torch.allclose(flat_state(run, "velocities"), velocities[rank], atol=1e-6), rank
        assert flat_state(run, "velocities").abs().sum() > 0
    # the user's param groups are as they wrote them after the run (the step ran with momentum and decay 0)
    assert [(g["momentum"], g["weight_decay"]) for g in result["param_groups"]] == [(0.9, 0.05), (0.5, 0.0)]
    ops = [op for link, op, tag, numel, dtype in result["trace"] if tag.startswith("bucket")]
    assert ops == (["all_reduce"] * 4 + ["all_gather"] * 8 if case == "dgc-warmup" else ["all_gather"] * 12)


def test_each_dgc_correction_changes_the_result(runs):
    """The reference tells each correction apart (so the equality above could not hold without it)."""
    result = runs("dgc")
    expected, _, _ = dgc_reference(result)
    assert max_abs_diff(expected, dgc_reference(result, masking=True)[0])[0] > 1e-4
    assert max_abs_diff(runs("dgc")["state"], runs("dgc-masked")["state"])[0] > 1e-4
    assert max_abs_diff(runs("dgc")["state"], runs("dgc-clipped")["state"])[0] > 1e-4
    assert max_abs_diff(runs("dgc")["state"], runs("dgc-nesterov")["state"])[0] > 1e-4


def test_a_resumed_dgc_run_equals_the_uninterrupted_one(runs):
    for rank in (0, 1):
        whole, resumed = runs("dgc", rank), runs("dgc-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] == 0.0
        for key in ("residuals", "velocities"):
            assert set(whole[key]) == set(resumed[key]) and whole[key]
            for name in whole[key]:
                assert torch.equal(whole[key][name], resumed[key][name]), (key, name)


def test_a_dgc_resume_at_another_world_size_keeps_the_sums_of_residuals_and_velocities(runs):
    for key in ("residuals", "velocities"):
        parts = [runs("dgc-part", rank)[key] for rank in (0, 1)]
        now = [runs("dgc-resharded", rank)[key] for rank in (0, 1, 2)]
        assert set(now[0]) == set(parts[0]) and parts[0]
        for name in parts[0]:
            owed = parts[0][name] + parts[1][name]
            assert torch.allclose(now[0][name] + now[1][name] + now[2][name], owed, atol=1e-6), (key, name)
            assert torch.allclose(now[2][name], owed / 3, atol=1e-7)
    assert "error-feedback residuals and velocities of 2 processes are re-sharded over 3" in runs.said


def test_the_corrections_and_the_warm_up_are_said_once_each(runs):
    assert "commsched topk: DGC's corrections under SGD: momentum correction, weight decay before " \
           "accumulation; the optimizer steps with momentum and weight decay 0" in runs.said
    assert "momentum correction, momentum factor masking, weight decay" in runs.said  # dgc-masked
    assert "local clipping to norm 0.05/sqrt(P) per parameter" in runs.said
    assert re.search(r"density warm-up 1 -> 0.25 -> 0.1 over the first 8 optimizer steps \(as set", runs.said)


def hierarchical_dgc_reference(result: dict, densities: list[float], masking: bool) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """One process, 4 ranks on 2 nodes, DGC split as the two-level exchange splits it: each rank's
    gradient / P plus its weight decay / P; each node sums its ranks' gradients per shard; the rank
    owning a shard keeps that shard's velocity (u <- m u + node sum, m per element from the parameter's
    group, 0 on the padding) and accumulation v, sends the 1-d elements and the k largest |v| of the
    rest across nodes (or all of v on a dense step), clears v where sent and, with `masking`, u where selected."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data

    world, nodes, compression = result["world"], result["nodes"], result["compression"]
    per_node = world // nodes
    names, padded, buckets = result["layout"]
    assert buckets == 1
    model = MLP(result["optimizer"])
    model.load_state_dict(result["initial"])
    by_name = dict(model.named_parameters())
    ordered = [by_name[n] for n in names]
    real_numel = sum(p.numel() for p in ordered)
    momentum = torch.zeros(padded)
    momentum[:real_numel] = torch.cat([torch.full((p.numel(),), sgd_terms(result["optimizer"], p)[0]) for p in ordered])
    x, y = data().tensors
    shares = rank_shares(data(), world, result["seed"])
    shard = padded // per_node
    vector = torch.zeros(padded, dtype=torch.bool)
    vector[:real_numel] = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in ordered])
    real = torch.arange(padded) < real_numel
    v = [torch.zeros(shard) for _ in range(world)]
    u = [torch.zeros(shard) for _ in range(world)]
    for t in range(result["steps"]):
        density = densities[t]
        dense = density >= 1 / nodes
        flats = []
        for r in range(world):
            idx = shares[r][t * BATCH:(t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), ordered)
            flat = torch.zeros(padded)
            flat[:real_numel] = torch.cat([(g / world + sgd_terms(result["optimizer"], p)[2] * p.detach() / world).reshape(-1)
                                           for g, p in zip(grads, ordered)])
            flats.append(flat)
        total = torch.zeros(padded)
        for node in range(nodes):
            for j in range(per_node):
                rank = node * per_node + j
                part = sum(flats[node * per_node + l][j * shard:(j + 1) * shard] for l in range(per_node))
                u[rank] = momentum[j * shard:(j + 1) * shard] * u[rank] + part
                v[rank] = v[rank] + u[rank]
                if dense:
                    total[j * shard:(j + 1) * shard] += v[rank]
                    v[rank] = torch.zeros(shard)
                    continue
                always, ranked, _ = sent_whole_and_ranked(vector[j * shard:(j + 1) * shard], real[j * shard:(j + 1) * shard], compression)
                k = min(ranked.numel(), max(1, math.ceil(density * ranked.numel())))
                top = ranked[torch.topk(v[rank][ranked].abs(), k).indices]
                chosen = torch.cat([always, top])
                total[j * shard + chosen] += v[rank][chosen]
                v[rank][chosen] = 0.0
                if masking:
                    u[rank][top] = 0.0
        lr = 0.2 / (1.0 + 0.05 * t)
        with torch.no_grad():
            for p, piece in zip(ordered, total[:real_numel].split([p.numel() for p in ordered])):
                p -= lr * piece.view_as(p)
    return {k: v_.detach() for k, v_ in model.state_dict().items()}, v, u


@needs_root
def test_hierarchical_dgc_equals_the_single_process_reference(two_nodes):
    """2 nodes x 2 workers, DGC's corrections (masking included) and the density's warm-up on the two-level exchange."""
    result = two_nodes("hier-dgc")
    expected, residuals, velocities = hierarchical_dgc_reference(result, [1.0] * 2 + [0.25] * 2 + [0.1] * 6, masking=True)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    names, padded, _ = result["layout"]
    for rank in range(4):
        mine = two_nodes("hier-dgc", rank)
        assert max_abs_diff(mine["state"], result["state"])[0] == 0.0
        for key, expected_shards in (("residuals", residuals), ("velocities", velocities)):
            whole = torch.zeros(padded)
            whole[:sum(mine[key][n].numel() for n in names)] = torch.cat([mine[key][n].reshape(-1) for n in names])
            assert torch.allclose(whole.view(2, -1)[rank % 2], expected_shards[rank], atol=1e-6), (key, rank)
    across = [op for link, op, tag, *_ in result["trace"] if tag.startswith("bucket") and link == "inter"]
    assert across == ["all_reduce"] * 2 + ["all_gather"] * 8


def test_a_dense_resume_of_dgc_velocities_is_refused_not_dropped(runs):
    refused = runs("dense-from-dgc")["refused"]
    assert "['momentum']" in refused and "resuming would drop it" in refused


def test_adamw_runs_the_defaults_as_error_feedback_alone_and_lightning_clips_it(runs):
    """The corrections are SGD's: under AdamW the defaults equal error feedback alone bit for bit, gradient
    clipping included (Lightning's, once), and no velocity is kept."""
    for rank in (0, 1):
        default, plain = runs("adamw-default", rank), runs("adamw-plain", rank)
        assert max_abs_diff(default["state"], plain["state"])[0] == 0.0
        assert default["velocities"] == {}
    assert "AdamW: DGC's corrections apply to torch's SGD (without dampening or maximize) only: error feedback alone" in runs.said
