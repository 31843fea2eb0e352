"""Steps the user writes by hand: Lightning's manual optimization (``automatic_optimization = False``) and
Fabric's loops.

Under automatic optimization the Trainer calls the strategy around one closure per step: forward,
backward, step. By hand, the user's `training_step` runs `self.manual_backward(loss)` and
`optimizer.step()` itself, as often as it likes: a GAN steps a generator's optimizer and then a
discriminator's on every batch, each after a backward of its own. DDP serves that by averaging the
gradients of every synchronised backward before it returns. So does every schedule here:

- the forward ends at the first backward of the step (DeAR's pending buckets land before it);
- each synchronised backward's collectives are finished when it returns (DeAR's all-gathers may still be
  on their way: the first read of a `.grad` waits for them, as under automatic optimization);
- `optimizer.step()` runs where the schedule holds the gradients; a step with no synchronised backward (none,
  or one kept local by `toggle_model(sync_grad=False)`) is the optimizer's own, as under DDP;
- with several optimizers, the schedules that step the model part by part in the next forward (DeAR,
  DeFT's plans) hand every iteration to WFBP: their deferred update belongs to one optimizer step, and the
  next backward would start before it landed. WFBP is DDP's schedule, exact on any number of optimizers;
- `toggle_optimizer` switches the other optimizers' parameters off for a backward: they keep their
  buckets (their gradients are missing, as under DDP), and the engine's checks at a batch start see
  every bucketed optimizer parameter as trainable, so that a toggle left on never drops a parameter from
  its bucket (`every_optimizer_trainable`); no bucket holds two optimizers' parameters, and a backward
  sends nothing for buckets no rank can fill (`GradientCapture.agree_on_idle`).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Container, Iterator, Sequence

from torch.optim import Optimizer

from commsched.errors import CommSchedConfigError
from commsched.options import StrategyOptions


@dataclasses.dataclass
class StepMarks:
    """Where the user's hand-written step is, between the strategy's calls."""

    forward_open: bool = False
    """`training_step` started and no backward ran yet: the forward ends at the first backward."""
    backward_pending: bool = False
    """A synchronised backward ran since the last optimizer step."""
    stepped_this_batch: bool = False
    """An optimizer step was taken in this batch (the step clock ticks once a batch)."""


def without_delays(options: StrategyOptions) -> StrategyOptions:
    """deft's plans without delay and without their guard: a delayed plan skips optimizer steps, which a
    loop written by hand takes itself, and its guard (`commsched.Preserver`) reads the Trainer's automatic
    steps."""
    if options.deft.capacity is None and not options.preserver.enabled:
        return options
    exact = dataclasses.replace(options.deft, capacity=None)
    schedule_options = exact if options.schedule_options is options.deft else options.schedule_options
    return dataclasses.replace(
        options,
        deft=exact,
        preserver=dataclasses.replace(options.preserver, enabled=False),
        schedule_options=schedule_options,
    )


def refuse_by_hand(options: StrategyOptions, optimizers: Sequence[Optimizer], name: str) -> None:
    """What a hand-written step with several optimizers cannot have: a sparse exchange keeps residuals per
    bucket across backwards, and one optimizer's backward would send another's residuals."""
    if len(optimizers) > 1 and options.compression.method != "none":
        raise CommSchedConfigError(
            f"commsched: invalid compression={options.compression.method!r} under strategy='{name}' with "
            f"{len(optimizers)} optimizers stepped by hand: each backward would send the other optimizers' "
            "residuals with its own gradients; allowed here: compression='none' (or one optimizer)"
        )


@contextmanager
def every_optimizer_trainable(optimizers: Sequence[Any], bucketed: Container[int]) -> Iterator[None]:
    """With several optimizers, the optimizers' parameters that have a bucket (`bucketed`: their ids) count as
    trainable while the engine plans and checks at a batch start (`toggle_optimizer` may have switched some
    off), then as the user left them; a parameter frozen from the start stays out of the buckets, as under
    DDP. `requires_grad_` reads and writes no values: pending parameters are not brought up to date by it."""
    many = len(optimizers) > 1
    off = [
        p
        for o in optimizers
        for g in o.param_groups
        for p in g["params"]
        if many and not p.requires_grad and id(p) in bucketed
    ]
    for p in off:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in off:
            p.requires_grad_(False)
