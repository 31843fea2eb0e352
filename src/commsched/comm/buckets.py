"""Flat per-bucket gradient buffers over the trainable parameters, and the plan that lays them out.

A `BucketPlan` is built identically on every rank from the module alone (names, shapes, dtypes,
ready order) and then checked: every rank hashes its plan and all-gathers the hashes, so a rank
whose model differs fails at setup with a message instead of corrupting gradients later.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from commsched.comm.links import Link
from commsched.errors import CommSchedConfigError
from commsched.fusion import ParamInfo


@dataclass
class Bucket:
    """One flat buffer; `views[i]` is parameter `params[i]`'s gradient inside it."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor  # padded to a multiple of the world size, padding kept at zero
    views: list[torch.Tensor]
    numel: int  # unpadded
    shard_numel: int  # buffer.numel() // world_size

    def offsets(self) -> list[int]:
        """Start of each parameter's gradient inside the flat buffer."""
        starts, offset = [], 0
        for p in self.params:
            starts.append(offset)
            offset += p.numel()
        return starts


@dataclass
class BucketPlan:
    """The buckets, in launch order (= backward order), and where each parameter lives."""

    buckets: list[Bucket]
    world_size: int
    sparse: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """Parameters whose gradients are sparse (`sparse_gradient_params`): outside the buckets, averaged as
    sparse tensors at the end of each synchronised backward (`commsched.comm.sparse_average`)."""

    @property
    def num_params(self) -> int:
        return sum(len(b.params) for b in self.buckets)

    def signature(self) -> str:
        lines = [f"world_size={self.world_size}"]
        for b in self.buckets:
            shapes = ",".join(f"{n}:{tuple(p.shape)}" for n, p in zip(b.names, b.params))
            lines.append(f"{b.index}|{b.buffer.dtype}|{b.buffer.device.type}|{b.buffer.numel()}|{shapes}")
        lines.extend(f"sparse|{n}:{tuple(p.shape)}|{p.dtype}" for n, p in self.sparse)
        return "\n".join(lines)

    def describe(self) -> str:
        return ", ".join(
            f"b{b.index}:{len(b.params)}p/{b.numel * b.buffer.element_size() / 2**20:.2f}MB" for b in self.buckets
        )


def sparse_gradient_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters whose gradients are sparse tensors: the weights of `nn.Embedding` and
    `nn.EmbeddingBag` made with ``sparse=True`` (what DDP looks for too), by name, in registration order."""
    sparse = {
        id(sub.weight)
        for sub in module.modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad
    }
    return [(n, p) for n, p in module.named_parameters() if id(p) in sparse]


def trainable_in_ready_order(module: nn.Module) -> tuple[list[str], list[nn.Parameter], list[int]]:
    """Trainable parameters with dense gradients in the order they usually become ready: reverse
    registration order (sparse gradients go apart: `sparse_gradient_params`).

    Returns names, parameters and, per parameter, the index of its owning module ("layer"), which
    the N-layers policy groups by. Tied parameters appear once, under their first owner.
    """
    owners: dict[int, int] = {}
    layer_of_module: dict[int, int] = {}
    for name, sub in module.named_modules():
        for p in sub.parameters(recurse=False):
            if p.requires_grad and id(p) not in owners:
                owners[id(p)] = layer_of_module.setdefault(id(sub), len(layer_of_module))
    sparse = {id(p) for _, p in sparse_gradient_params(module)}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in sparse]
    named.reverse()
    n_layers = len(layer_of_module)
    names = [n for n, _ in named]
    params = [p for _, p in named]
    layers = [n_layers - 1 - owners[id(p)] for p in params]
    return names, params, layers


def param_infos(module: nn.Module) -> list[ParamInfo]:
    """What a fusion planner sees of each trainable parameter, in ready order."""
    return [
        ParamInfo(n, p.numel(), p.element_size(), p.dtype, p.device, layer)
        for n, p, layer in zip(*trainable_in_ready_order(module))
    ]


def build_plan(
    module: nn.Module,
    world_size: int,
    planner: Callable[[Sequence[ParamInfo]], list[list[int]]],
    apart: Optional[Callable[[nn.Parameter], int]] = None,
) -> BucketPlan:
    """`apart`: a key per parameter (the optimizer that steps it): the planner's buckets are cut where the
    key changes, so that no bucket holds parameters of two keys."""
    lazy = next((n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)), None)
    if lazy is not None:
        raise CommSchedConfigError(
            f"commsched: parameter '{lazy}' is not made yet (a lazy module, e.g. nn.LazyLinear): its size is known "
            "only after a forward. Run one forward with a dummy batch before fit (in the module's __init__ or "
            "setup()), as DDP requires too."
        )
    names, params, _ = trainable_in_ready_order(module)
    sparse = sparse_gradient_params(module)
    if not params and not sparse:
        raise CommSchedConfigError(
            "commsched: the model has no trainable parameters (requires_grad=True); nothing to synchronise."
        )
    groups = planner(param_infos(module)) if params else []  # sparse tables alone: no bucket
    if apart is not None:
        groups = [part for group in groups for part in cut_where_key_changes(group, [apart(params[i]) for i in group])]
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(len(params))):
        raise RuntimeError(f"commsched: fusion planner returned an invalid grouping {groups}")
    buckets = []
    for index, group in enumerate(groups):
        numel = sum(params[i].numel() for i in group)
        padded = -(-numel // world_size) * world_size
        first = params[group[0]]
        buffer = torch.zeros(padded, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for i in group:
            n = params[i].numel()
            views.append(buffer.narrow(0, offset, n).view_as(params[i]))
            offset += n
        buckets.append(
            Bucket(
                index, [names[i] for i in group], [params[i] for i in group], buffer, views, numel, padded // world_size
            )
        )
    return BucketPlan(buckets, world_size, sparse)


def cut_where_key_changes(group: list[int], keys: list[int]) -> list[list[int]]:
    """`group` cut into runs of consecutive members with the same key."""
    runs: list[list[int]] = []
    for i, (index, key) in enumerate(zip(group, keys)):
        if i and key == keys[i - 1]:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def module_layout(module: nn.Module) -> str:
    """Names, shapes and dtypes of every parameter and buffer: what rank 0's broadcast overwrites."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return "\n".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in tensors)


def verify_same_on_all_ranks(plan: BucketPlan, module: nn.Module, link: Link, extra: str = "") -> None:
    """All-gather one hash of plan, module layout and `extra` (the schedule's settings); every rank
    raises the same error if any differs.

    Runs before anything is broadcast or reduced: mismatched messages would corrupt or hang.
    """
    text = plan.signature() + "\n" + module_layout(module) + "\n" + extra
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    digests = link.all_gather_int(digest, "model-layout-hash")
    if len(set(digests)) != 1:
        raise CommSchedConfigError(
            "commsched: the model or its bucket plan differs between ranks (hash per rank: "
            f"{digests}). Every rank must build the same model: the same parameters and buffers with the "
            "same names, shapes, dtypes and registration order, and the same callbacks. This rank's plan:\n"
            + plan.describe()
            + "\n"
            + extra
        )
