"""Spike compensation of delayed generations (Kosson et al., Pipelined Backpropagation at Scale, 2021).

Under SGD with momentum m, a gradient applied at some step moves the weights by lr m^j at each step j
after it, lr / (1 - m) in all. A generation applied D optimizer steps after its newest gradient was
taken has missed the first D of those moves, lr (1 - m^D) / (1 - m). Spike compensation applies that
part at once, with the step, and lets the velocity carry the rest scaled by m^D: every gradient's
total weight is then the synchronous one, only its timing differs. At D = 1 it is Nesterov's momentum
(with the velocity scaled by m).

The user's SGD still steps, at its own learning rate, momentum and schedule: its gradient and weight
decay are scaled by m^D for that step (restored after), and the missed part, lr (1 - m^D) / (1 - m)
times (g + weight_decay w), is applied beside it. A group without momentum steps as it would.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import Optimizer

COMPENSATIONS = ("none", "spike", "predict", "spike+predict")
"""Besides spike: "predict", linear weight prediction (`commsched.deft.prediction`); "spike+predict", both."""


def spike_applies(optimizer: Optimizer) -> bool:
    """torch's SGD (or a subclass) with heavy-ball momentum: no dampening, Nesterov or maximize."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        not group.get("dampening", 0) and not group.get("nesterov", False) and not group.get("maximize", False)
        for group in optimizer.param_groups)


@torch.no_grad()
def spike_step(optimizer: Optimizer, real_step: Callable[[], Any], delay: int) -> None:
    """`real_step` (the user's `optimizer.step`) for gradients `delay` optimizer steps late."""
    if delay <= 0:
        real_step()
        return
    missed: list[tuple[dict, float, float, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    for group in optimizer.param_groups:
        momentum, decay = group["momentum"], group["weight_decay"]
        if not momentum:
            continue
        kept = momentum ** delay
        late = [(p, p.grad + decay * p if decay else p.grad.clone()) for p in group["params"] if p.grad is not None]
        for p, _ in late:
            p.grad.mul_(kept)
        group["weight_decay"] = decay * kept
        missed.append((group, (1 - kept) / (1 - momentum), decay, late))
    try:
        real_step()
    finally:
        for group, _, decay, _ in missed:
            group["weight_decay"] = decay
    for group, share, _, late in missed:
        kept = group["momentum"] ** delay
        for p, direction in late:
            p.add_(direction, alpha=-group["lr"] * share)
            p.grad.div_(kept)  # callbacks reading `.grad` after the step see the gradient that was averaged
