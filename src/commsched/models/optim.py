"""The optimizer and LR schedule every model of the zoo shares, chosen by name from the config."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from commsched.errors import bad_value

OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine")


def configure(
    parameters: Iterable[nn.Parameter],
    optimizer: str,
    lr: float,
    weight_decay: float,
    momentum: float,
    lr_schedule: str,
    total_steps: int,
) -> dict[str, Any]:
    """Build what `configure_optimizers` returns; the cosine schedule steps per optimizer step."""
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    else:
        raise bad_value("model.optimizer", optimizer, OPTIMIZERS)
    if lr_schedule == "constant":
        return {"optimizer": opt}
    if lr_schedule != "cosine":
        raise bad_value("model.lr_schedule", lr_schedule, LR_SCHEDULES)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total_steps))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class HparamsOptimizer:
    """Mixin for LightningModules whose hparams hold optimizer, lr, weight_decay, momentum and lr_schedule."""

    def configure_optimizers(self) -> dict[str, Any]:
        h = self.hparams  # type: ignore[attr-defined]
        return configure(
            self.parameters(),
            h.optimizer,
            h.lr,
            h.weight_decay,
            h.momentum,
            h.lr_schedule,  # type: ignore[attr-defined]
            self.trainer.estimated_stepping_batches,  # type: ignore[attr-defined]
        )
