"""LARS (You et al., 2018) with its per-layer norms computed in parallel across ranks ([Cloud-TopK]
§4.2, PTO).

Each parameter tensor l gets the local learning rate of [Cloud-TopK] Eq. 11,
    lambda_l = trust_coefficient * |w_l| / (|g_l| + weight_decay * |w_l|),
and heavy-ball momentum on lambda_l * (g_l + weight_decay * w_l), scaled by the group's lr. After
the exchange every rank holds the same weights and gradients, so every rank would compute the same
2 L norms: with `parallel_norms`, rank r computes those of its contiguous share of the tensors
(the paper: "the first GPU calculates layers 1 to 2, the second 3 to 4") and one all-reduce of a
2 L vector, zero outside each rank's share, gives every rank all of them. The result is exact: the
norms are the same computations on the same tensors, only done once.

That needs every rank to hold whole gradients at `step()` and to call it at the same time: `ddp`,
`wfbp` (compressed or not). DeAR steps bucket by bucket after its all-gathers and DeFT steps
generations when they complete: the strategies refuse LARS with parallel norms there.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from commsched.options import flag, non_negative_number, positive_number


class LARS(Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        adapt_1d: bool = False,
        parallel_norms: bool = True,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """
        Args:
            lr: the global learning rate (gamma x eta_t of Eq. 11; schedulers change it as usual).
            momentum: heavy-ball momentum of the scaled update.
            weight_decay: epsilon of Eq. 11, also added to the gradient.
            trust_coefficient: how far a layer may move relative to its weights' norm.
            adapt_1d: also scale biases and normalisation weights (commonly left at the global rate).
            parallel_norms: compute each rank's share of the norms and all-reduce them (when a process
                group is initialised with more than one rank); False: every rank computes them all.
            group: the process group of the data-parallel ranks (default: the default group).
        """
        defaults = {
            "lr": positive_number("LARS.lr", lr),
            "momentum": non_negative_number("LARS.momentum", momentum),
            "weight_decay": non_negative_number("LARS.weight_decay", weight_decay),
            "trust_coefficient": positive_number("LARS.trust_coefficient", trust_coefficient),
            "adapt_1d": flag("LARS.adapt_1d", adapt_1d),
        }
        super().__init__(params, defaults)
        self.parallel_norms = flag("LARS.parallel_norms", parallel_norms)
        self.group = group
        self.norm_exchanges = 0
        """Steps whose norms were shared out across ranks and all-reduced."""

    def _world(self) -> tuple[int, int]:
        if not self.parallel_norms or not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def norms(self, params: list[torch.Tensor]) -> torch.Tensor:
        """[|w_l|, |g_l|] for every parameter with a gradient, shape (L, 2): this rank's share computed
        here, the rest by the other ranks (parallel norms) or here too."""
        rank, world = self._world()
        out = torch.zeros(len(params), 2, dtype=torch.float32, device=params[0].device if params else "cpu")
        per_rank = -(-len(params) // world) if params else 0
        mine = range(rank * per_rank, min(len(params), (rank + 1) * per_rank)) if world > 1 else range(len(params))
        for i in mine:
            out[i, 0] = params[i].detach().norm()
            out[i, 1] = params[i].grad.detach().norm()  # type: ignore[union-attr]
        if world > 1:
            dist.all_reduce(out, group=self.group)
            self.norm_exchanges += 1
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepping = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        norms = self.norms([p for _, p in stepping])
        for (group, p), (weight_norm, grad_norm) in zip(stepping, norms):
            update = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad.clone()
            if p.ndim > 1 or group["adapt_1d"]:
                denominator = grad_norm + group["weight_decay"] * weight_norm
                trust = (
                    group["trust_coefficient"] * weight_norm / denominator
                    if weight_norm > 0 and denominator > 0
                    else 1.0
                )
                update.mul_(trust)
            if group["momentum"]:
                state = self.state[p]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    state["momentum_buffer"] = buffer = update.clone()
                else:
                    buffer.mul_(group["momentum"]).add_(update)
                update = buffer
            p.add_(update, alpha=-group["lr"])
        return loss
