"""What the strategy hands DeFT besides buckets and links: its options, the Preserver that guards its
plans (the user's own, or one made from `PreserverOptions`), and the refusal of optimizers a
compensation cannot serve, checked at setup before any step."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch.optim import Optimizer

from commsched.deft.spike_compensation import COMPENSATIONS, spike_applies
from commsched.errors import CommSchedConfigError
from commsched.loss_scale import scaler_of
from commsched.options import DeFTOptions, StrategyOptions
from commsched.say import say


@dataclass
class DeFTSettings:
    """What the strategy hands DeFT besides buckets and links."""

    options: DeFTOptions = field(default_factory=DeFTOptions)
    preserver: Any = None
    """A `commsched.Preserver` among the Trainer's callbacks, if any."""
    advance_schedulers: Callable[[], None] = lambda: None
    """Steps the per-step LR schedulers once (before a second optimizer step in one iteration)."""


def settings_for(options: StrategyOptions, trainer: Any, advance_schedulers: Callable[[], None]) -> DeFTSettings:
    """The Preserver: the user's own among the callbacks, else one made from `options.preserver`
    and added to the callbacks (it reads each step's loss and learning rate), unless disabled."""
    from commsched.deft.preserver import Preserver

    preserver = next((c for c in trainer.callbacks if isinstance(c, Preserver)), None)
    guard = options.preserver
    if preserver is None and guard.enabled:
        preserver = Preserver(
            guard.eps,
            guard.max_tries,
            guard.growth,
            recheck_every_n_steps=guard.recheck_every_n_steps,
            max_staleness=guard.max_staleness,
            curvature_margin=guard.curvature_margin,
            watch_steps=guard.watch_steps,
            rollback=guard.rollback,
            stale_after_steps=guard.stale_after_steps,
        )
        trainer.callbacks.append(preserver)
    deft = options.deft
    if scaler_of(trainer.precision_plugin) is not None and deft.capacity is not None:
        say(
            "commsched deft: fp16 with a GradScaler: plans without delay only (a generation summed over several "
            "iterations would mix loss scales, and one iteration's inf would discard them all); bf16-mixed delays"
        )
        deft = dataclasses.replace(deft, capacity=None)
    return DeFTSettings(deft, preserver, advance_schedulers)


FALLBACK_EPOCH_STEPS = 200
"""Steps a stale plan waits by default where the training loader has no length (no epoch to count)."""


def stale_barred(preserver: Any, refused: bool, module: Any) -> tuple[Optional[str], Optional[int]]:
    """Why no stale plan may run now (None: it may), and the step from which it may (None: never, or now).
    After a stop by the watch, never; before `stale_after_steps` steps of training (default one epoch), not yet."""
    if refused:
        return "refused (the watch stopped one earlier in this run)", None
    trainer = getattr(module, "_trainer", None)
    if preserver is None or trainer is None or not preserver.max_staleness:
        return None, None
    wait = preserver.stale_after_steps
    if wait is None:  # one epoch, in optimizer steps (the last, incomplete accumulation steps too)
        batches = trainer.num_training_batches
        wait = (
            FALLBACK_EPOCH_STEPS if math.isinf(batches) else -(-int(batches) // max(1, trainer.accumulate_grad_batches))
        )
    if steps_trained(module) >= wait:
        return None, None
    reason = f"wait until step {wait} (stale_after_steps; now at step {steps_trained(module)})"
    if wait >= trainer.estimated_stepping_batches:
        reason += (
            "; this run ends before it, so no stale plan will run (set preserver.stale_after_steps to start earlier)"
        )
    return reason, wait


def users_optimizer(stepper: Optional[tuple[Optimizer, Any]], module: Any) -> Optional[Optimizer]:
    """The user's optimizer: the one last stepped, else (resumed, nothing stepped yet) the Trainer's."""
    trainer = getattr(module, "_trainer", None)
    return stepper[0] if stepper else trainer.optimizers[0] if trainer is not None and trainer.optimizers else None


def steps_trained(module: Any) -> int:
    """The Trainer's global step (0 outside a Trainer)."""
    trainer = getattr(module, "_trainer", None)
    return trainer.global_step if trainer is not None else 0


def refuse_uncompensable_optimizers(compensation: str, optimizers: list[Optimizer]) -> None:
    """Spike compensation stands in for heavy-ball momentum: refused for any other optimizer."""
    if not compensation.startswith("spike"):
        return
    refused = [type(opt).__name__ for opt in optimizers if not spike_applies(opt)]
    if refused:
        raise CommSchedConfigError(
            f"commsched deft: compensation='{compensation}' stands in for heavy-ball momentum, and applies to "
            f"torch's SGD without dampening, Nesterov or maximize; this run's optimizer is {', '.join(refused)}. "
            f"Allowed values of compensation: {', '.join(COMPENSATIONS)}; use 'none' or 'predict' with this optimizer"
        )
