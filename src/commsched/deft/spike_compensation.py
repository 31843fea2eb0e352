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

COMPENSATIONS = ("auto", "none", "spike", "predict", "spike+predict")
"""Besides spike: "predict", linear weight prediction (`commsched.deft.weight_prediction`); "spike+predict",
both; "auto", the one measured to keep this optimizer's accuracy one step late (`chosen_for`)."""

MEASURED_MOMENTUM = 0.9
"""The momentum (SGD's, or Adam's beta1) of the runs where compensation was measured to help one step
late: below it, none was (at momentum 0.5 each was within noise of none, at 0 prediction cost points:
it extrapolates along one noisy gradient)."""


def chosen_for(optimizer: Optimizer) -> str:
    """What "auto" runs with this optimizer: spike compensation with weight prediction for SGD with
    heavy-ball momentum >= 0.9 in every group, prediction for Adam and AdamW (beta1 >= 0.9), else none:
    the compensation that recovered the most of what one step of staleness costs, measured from DeFT's
    decision on (after its synchronous warm-up and measured steps; docs/deft.md, "Compensating the delay")."""
    groups = optimizer.param_groups
    if spike_applies(optimizer) and all(group.get("momentum", 0) >= MEASURED_MOMENTUM for group in groups):
        return "spike+predict"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        group["betas"][0] >= MEASURED_MOMENTUM for group in groups
    ):
        return "predict"
    return "none"


def resolve_compensation(requested: str, optimizer: Optimizer) -> str:
    """The compensation that runs: `requested`, or with "auto" `chosen_for(optimizer)`."""
    return chosen_for(optimizer) if requested == "auto" else requested


def measured_staleness(compensation: str, optimizer: Optimizer) -> int:
    """How late a generation may step with this compensation and optimizer and still keep accuracy, as
    measured: one iteration for SGD with momentum >= 0.9 under spike compensation with weight prediction
    (within 0.6 points of synchronous, or above it, on two of the digits' BatchNorm networks, though not
    on VGG-16-BN); none otherwise. Under AdamW prediction took most of the cost away on those networks
    but left GPT-2 tiny's held-out loss 1-23% above synchronous."""
    return 1 if compensation == "spike+predict" and chosen_for(optimizer) == "spike+predict" else 0


def spike_applies(optimizer: Optimizer) -> bool:
    """torch's SGD (or a subclass) with heavy-ball momentum: no dampening, Nesterov or maximize."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        not group.get("dampening", 0) and not group.get("nesterov", False) and not group.get("maximize", False)
        for group in optimizer.param_groups
    )


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
        kept = momentum**delay
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
