"""What the strategy hands DeFT besides buckets and links: its options, the Preserver that guards its
plans (the user's own, or one made from `PreserverOptions`), and the refusal of optimizers a
compensation cannot serve, checked at setup before any step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch.optim import Optimizer

from commsched.deft.compensation import COMPENSATIONS, spike_applies
from commsched.errors import CommSchedConfigError
from commsched.options import DeFTOptions, StrategyOptions


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
        preserver = Preserver(guard.eps, guard.max_tries, guard.growth, recheck_every_n_steps=guard.recheck_every_n_steps,
                              max_staleness=guard.max_staleness, curvature_margin=guard.curvature_margin,
                              watch_steps=guard.watch_steps, rollback=guard.rollback)
        trainer.callbacks.append(preserver)
    return DeFTSettings(options.deft, preserver, advance_schedulers)


def refuse_optimizers(compensation: str, optimizers: list[Optimizer]) -> None:
    """Spike compensation stands in for heavy-ball momentum: refused for any other optimizer."""
    if not compensation.startswith("spike"):
        return
    refused = [type(opt).__name__ for opt in optimizers if not spike_applies(opt)]
    if refused:
        raise CommSchedConfigError(
            f"commsched deft: compensation='{compensation}' stands in for heavy-ball momentum, and applies to torch's SGD "
            f"without dampening, Nesterov or maximize; this run's optimizer is {', '.join(refused)}. Allowed "
            f"values of compensation: {', '.join(COMPENSATIONS)}; use 'none' or 'predict' with this optimizer")
