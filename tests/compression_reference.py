"""The compression tests' shared parts: the multi-process runs (one set per session, read by
test_compression.py and test_compression_dgc.py) and the single-process references of each exchange,
written apart from the engine."""

from __future__ import annotations

import math
import sys
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from commsched.cluster import netns
from conftest import WORKERS, run_worker


# ------------------------------------------------------------ exchanges
@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression")
    proc = run_worker(
        "run_compression.py",
        str(out),
        "2",
        "topk",
        "topk-part",
        "topk-resumed",
        "topk-no-feedback",
        "topk-auto",
        "mstopk",
        "topk-dense-phases",
        "mstopk-whole",
        "dense",
        "dense-from-topk",
        "topk-every-element",
        "dgc",
        "dgc-part",
        "dgc-resumed",
        "dgc-nesterov",
        "dgc-clipped",
        "dgc-masked",
        "dgc-warmup",
        "dense-from-dgc",
        "adamw-default",
        "adamw-plain",
        "fp16-all-skipped",
        "fp16-some-skipped",
    )
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
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optimizer.step()
    scheduler.step()


def sent_whole_and_ranked(
    vector: torch.Tensor, real: torch.Tensor, compression: dict
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Of a window whose 1-d parameters' positions are `vector` and whose parameters' (not padding)
    are `real`: the positions always sent, those ranked, and k, the density's share of the ranked
    ones (at least one)."""
    if not compression.get("whole_vectors", True):
        vector = torch.zeros_like(vector)
    ranked = (~vector & real).nonzero().flatten()
    return (
        vector.nonzero().flatten(),
        ranked,
        min(ranked.numel(), max(1, math.ceil(compression["density"] * ranked.numel()))),
    )


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
        dense = t < compression.get("dense_warmup_steps", 0) or t >= result["steps"] - compression.get(
            "dense_final_steps", 0
        )
        dense = dense or (dense_steps is not None and t in dense_steps)
        for r in range(world):
            idx = shares[r][t * BATCH : (t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
            mine = torch.cat([g.reshape(-1) for g in grads]) / world
            if compression["error_feedback"]:
                mine = mine + residuals[r]
            chosen = (
                torch.arange(numel) if dense else torch.cat([always, ranked[torch.topk(mine[ranked].abs(), k).indices]])
            )
            sent = torch.zeros(numel)
            sent[chosen] = mine[chosen]
            if compression["error_feedback"]:
                residuals[r] = mine - sent
            total += sent
        step_with(params, total, optimizer, scheduler)
    return {k: v.detach() for k, v in model.state_dict().items()}, residuals


def flat_residual(result: dict, params: list[str]) -> torch.Tensor:
    return torch.cat([result["residuals"][name].reshape(-1) for name in params])


needs_root = pytest.mark.skipif(
    netns.unavailable_reason() is not None, reason=f"no emulated cluster here: {netns.unavailable_reason()}"
)


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    import subprocess
    from pathlib import Path

    out = tmp_path_factory.mktemp("hierarchical")
    command = [
        str(Path(sys.executable).parent / "commsched-cluster"),
        "--nodes",
        "2",
        "--workers-per-node",
        "2",
        "--rate",
        "1gbit",
        "--",
        sys.executable,
        str(WORKERS / "run_hierarchical.py"),
        str(out),
        "2",
        "2",
        "flat-dense",
        "hier-dense",
        "hier-topk",
        "hier-mstopk",
        "hier-topk-phases",
        "hier-dense-streams",
        "auto-two-level",
        "hier-dgc",
    ]
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
    vector[: sum(p.numel() for p in ordered)] = torch.cat([torch.full((p.numel(),), p.dim() == 1) for p in ordered])
    real = torch.arange(padded) < sum(p.numel() for p in ordered)
    windows = [
        sent_whole_and_ranked(vector[j * shard : (j + 1) * shard], real[j * shard : (j + 1) * shard], compression)
        for j in range(per_node)
    ]
    residuals = [torch.zeros(shard) for _ in range(world)]
    for t in range(result["steps"]):
        dense = t < compression["dense_warmup_steps"] or t >= result["steps"] - compression["dense_final_steps"]
        flats = []
        for r in range(world):
            idx = shares[r][t * BATCH : (t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), ordered)
            flat = torch.zeros(padded)
            flat[: sum(p.numel() for p in ordered)] = torch.cat([g.reshape(-1) for g in grads]) / world
            flats.append(flat)
        total = torch.zeros(padded)
        for node in range(nodes):
            for j in range(per_node):
                part = sum(flats[node * per_node + l][j * shard : (j + 1) * shard] for l in range(per_node))
                rank = node * per_node + j
                part = part + residuals[rank]
                always, ranked, k = windows[j]
                chosen = (
                    torch.arange(shard)
                    if dense
                    else torch.cat([always, ranked[torch.topk(part[ranked].abs(), k).indices]])
                )
                sent = torch.zeros(shard)
                sent[chosen] = part[chosen]
                residuals[rank] = part - sent
                total[j * shard : (j + 1) * shard] += sent
        step_with(ordered, total, optimizer, scheduler)
    return {k: v.detach() for k, v in model.state_dict().items()}, residuals


# ------------------------------------------------------- DGC's corrections (the defaults under SGD)
def sgd_terms(optimizer: str, param: torch.Tensor) -> tuple[float, bool, float]:
    """(momentum, nesterov, weight decay) that run_deft's "sgd-groups"/"sgd-nesterov" give a parameter:
    weights momentum 0.9 and decay 0.05, biases momentum 0.5 and no decay."""
    return (0.9, optimizer == "sgd-nesterov", 0.05) if param.dim() > 1 else (0.5, optimizer == "sgd-nesterov", 0.0)


def dgc_reference(
    result: dict, densities: Optional[list[float]] = None, masking: bool = False
) -> tuple[dict, list, list]:
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
            idx = shares[r][t * BATCH : (t + 1) * BATCH]
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
    return (
        {k: v_.detach() for k, v_ in model.state_dict().items()},
        v,
        [torch.cat([piece.reshape(-1) for piece in ur]) for ur in u],
    )


def flat_state(result: dict, key: str) -> torch.Tensor:
    names = [n for n, _ in __import__("run_deft").MLP("sgd").named_parameters()]
    return torch.cat([result[key][name].reshape(-1) for name in names])


def hierarchical_dgc_reference(
    result: dict, densities: list[float], masking: bool
) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
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
            idx = shares[r][t * BATCH : (t + 1) * BATCH]
            grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), ordered)
            flat = torch.zeros(padded)
            flat[:real_numel] = torch.cat(
                [
                    (g / world + sgd_terms(result["optimizer"], p)[2] * p.detach() / world).reshape(-1)
                    for g, p in zip(grads, ordered)
                ]
            )
            flats.append(flat)
        total = torch.zeros(padded)
        for node in range(nodes):
            for j in range(per_node):
                rank = node * per_node + j
                part = sum(flats[node * per_node + l][j * shard : (j + 1) * shard] for l in range(per_node))
                u[rank] = momentum[j * shard : (j + 1) * shard] * u[rank] + part
                v[rank] = v[rank] + u[rank]
                if dense:
                    total[j * shard : (j + 1) * shard] += v[rank]
                    v[rank] = torch.zeros(shard)
                    continue
                always, ranked, _ = sent_whole_and_ranked(
                    vector[j * shard : (j + 1) * shard], real[j * shard : (j + 1) * shard], compression
                )
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
