"""Options of DeAR: whether WFBP runs the iterations where it measured faster, and the rollback copies."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from commsched.errors import bad_value
from commsched.options.validators import flag, non_negative_number, one_of, option, positive_int


def optimizer_classes(name: str, value: Any) -> list[Any]:
    """Classes, or their `package.module.Class` names: the module is found now, before any worker
    starts (the class is imported and checked when the run starts)."""
    allowed = "a list of optimizer classes or 'package.module.Class' names"
    if not isinstance(value, (list, tuple)):
        raise bad_value(name, value, allowed)
    for entry in value:
        if isinstance(entry, type):
            continue
        module = entry.rpartition(".")[0] if isinstance(entry, str) else ""
        try:
            found = bool(module) and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise bad_value(name, value, allowed, fix=f"{entry!r} names no module this Python can import")
    return list(value)


@dataclass
class DeAROptions:
    """DeAR ([DeAR]): each bucket's all-reduce split into a reduce-scatter in backward and an all-gather
    in the next forward."""

    fallback: str = option("when_faster", one_of("when_faster", "never"))
    """"when_faster": once the buckets are decided, the bounds of DeAR and WFBP (DDP's schedule: the
    same math, one all-reduce per bucket in backward) for the profiled components predict which is
    faster, the two take turns on real steps, and WFBP runs the iterations where the model favours it
    or it measured faster beyond the noise (a fast link leaves DeAR nothing to hide, and its two
    collectives per bucket cost more CPU than one); compared again after 500 and 5,000 steps and when
    the steps drift. "never": DeAR always. With several streams (`streams`), DeAR always."""
    confirm_steps: int = option(3, positive_int)
    """Timed steps per turn (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """Turns each schedule takes before the measured steps may overrule the model (steps that agree with it decide
    after two)."""
    confirm_max_rounds: int = option(6, positive_int)
    """Turns each schedule may take in all when the steps lean against the model's choice within their
    noise (more turns until the difference is resolved; at least `confirm_rounds`)."""
    drift: float = option(0.2, non_negative_number)
    """A median step this much slower than the kept schedule measured compares them again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """Steps per median watched for drift."""
    rollback: bool = option(True, flag)
    """A bucket's update applied while later all-gathers of the same step are still on the network
    first copies the bucket's parameters and optimizer state: a run that fails part-way (a peer
    died) takes the step back, so what is saved after the failure is the model before that step,
    whole. Costs the memory of the parameters and optimizer state applied early (allocated once,
    reused every step; none where the all-gathers land before the forward needs them) and the copy
    (within noise where measured). False: no copies, and a failure part-way leaves weights that mix
    two steps (said when it happens)."""
    per_parameter: list[Any] = field(default_factory=list, metadata={"check": optimizer_classes})
    """Optimizer classes (or `package.module.Class` names) whose step computes each parameter's update
    from that parameter's gradient and state alone, besides those known to (torch's SGD, Adam, AdamW,
    RMSprop, Adagrad, Adamax, NAdam, RAdam, ASGD, Adadelta, Rprop and lion-pytorch's Lion): DeAR steps
    them bucket by bucket as each bucket's all-gather lands. Any other optimizer is stepped whole once
    every all-gather of the step has landed (exact, with less overlap): one that sums over a whole group
    inside its step (Prodigy, D-Adaptation) or keeps group-level state (schedule-free) must be. A declared
    class is checked before its first split step (a split and a whole step on random tensors must agree)."""
