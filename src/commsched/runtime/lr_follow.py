"""Per-step LR schedulers follow optimizer steps, for schedules that skip some (DeFT).

Lightning steps a scheduler with ``interval="step"`` once per training batch, through the
LightningModule's `lr_scheduler_step`. Under DeFT an iteration may take no optimizer step (its
gradients wait in a generation) or two (two generations complete). A learning-rate schedule is a
function of optimizer steps (warm-up over steps, cosine over steps), so each such scheduler steps
exactly as often as the optimizer did: skipped on iterations without a step, and stepped once more
before each extra step of the same iteration, so that every optimizer step sees the learning rate
a synchronous run's step of the same number would. The module's hook is wrapped on the instance
(the user's own `lr_scheduler_step` still runs) and unwrapped at teardown.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn


class FollowOptimizerSteps:
    def __init__(self, module: "pl.LightningModule", configs: list[Any], steps_taken: Callable[[], int]) -> None:
        self._module = module
        self._followed = []
        for config in configs:
            if config.interval != "step":
                continue
            if config.frequency != 1:
                rank_zero_warn(
                    f"commsched: LR scheduler {type(config.scheduler).__name__} steps every {config.frequency} "
                    "batches; it follows iterations, not optimizer steps"
                )
                continue
            self._followed.append(config.scheduler)
        original = module.lr_scheduler_step
        followed = {id(s) for s in self._followed}

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if id(scheduler) not in followed or steps_taken() > 0:
                original(scheduler, metric)

        self._original = original
        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    def advance(self) -> None:
        """One extra step of every followed scheduler (before a second optimizer step in one iteration)."""
        for scheduler in self._followed:
            self._original(scheduler, None)

    def remove(self) -> None:
        self._module.__dict__.pop("lr_scheduler_step", None)
        self._followed.clear()
