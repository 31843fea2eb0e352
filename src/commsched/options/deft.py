"""Options of DeFT's delayed updates and of the Preserver that guards them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from commsched.errors import bad_value
from commsched.options.catalogue import FALLBACKS
from commsched.options.validators import (
    flag,
    is_real,
    non_negative_int,
    non_negative_number,
    one_of,
    option,
    optional,
    positive_int,
    text,
)


def capacity_value(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if not (is_real(value) and value > 0):
        raise bad_value(name, value, "a number > 0 (a multiple of the stage times), or unset (None, null) for no delay")
    return float(value)


@dataclass
class DeFTOptions:
    """DeFT ([DeFT] §III-IV): delayed updates over two links, solved from the run's own measurements."""

    warmup_steps: int = option(5, non_negative_int)
    """Steps run without delay and left out before measuring (a CPU run's first steps are slow)."""
    measure_steps: int = option(5, positive_int)
    """Steps without delay whose stage times and gradient statistics are measured before solving."""
    cost_repeats: int = option(3, positive_int)
    """Timed all-reduces of each bucket on each link (the median counts) when measuring ends."""
    capacity: Optional[float] = option(1.0, capacity_value)
    """The knapsacks' capacity as a multiple of the measured stage times; larger sends more per
    iteration (fewer delays); null: everything fits, no delay (DDP's updates). The Preserver may raise it."""
    timings_file: Optional[str] = option(None, optional(text))
    """A JSON file of per-bucket times (``forward``, ``backward``, ``costs``): solve from these instead of
    measuring (a reproducible or forced plan)."""
    fallback: str = option("when_faster", one_of(*FALLBACKS))
    """Which exact schedule may run the iterations instead of the plan, on the same buckets:
    "when_faster": of WFBP on the primary (DDP's schedule without generations, always a candidate),
    DeAR (its reduce-scatter and all-gather of each bucket are timed too, on each link with a network
    of its own) and the plan, the one predicted fastest, a more complex one (the plan over DeAR over
    WFBP) only when predicted at least 2% faster; "when_undelayed": DeAR whenever the plan delays
    nothing; "never": the plan. DeAR never when callbacks read gradients
    or weights every step (it gives up its overlap then); with a timings file, only if the file
    gives DeAR's halves too."""
    compensation: str = option("auto", one_of("auto", "none", "spike", "predict", "spike+predict"))
    """What a generation applied late gets: "auto": the compensation measured to keep accuracy one
    iteration late with this run's optimizer ("spike+predict" for SGD with heavy-ball momentum >= 0.9,
    "predict" for Adam and AdamW with beta1 >= 0.9, else "none"); "none" (its gradient as it is); "spike": under
    torch's SGD with heavy-ball momentum, the moves its gradient missed while late, lr (1 - m^D) / (1 - m) for D
    optimizer steps, are applied at once and its velocity scaled by m^D, so that each gradient's total
    weight is the synchronous one (Kosson et al. 2021; Nesterov's momentum at D = 1; other optimizers
    are refused with it); "predict": any optimizer; the forward and backward of an iteration whose
    gradient will be applied D steps later run on the weights extrapolated D updates along the last
    one (one more copy of the parameters, kept in checkpoints); "spike+predict": both."""
    confirm_steps: int = option(3, non_negative_int)
    """With fallback "when_faster": timed steps per turn when the predicted choice and its runner-up
    (the best two of WFBP, DeAR and the plan) take turns, twice each, on real steps (one more step runs first each
    turn, untimed); the simpler of the two is kept unless the other beats it by more than the measured
    noise (`commsched.interleaved`). 0: the prediction alone decides."""


def eps_value(name: str, value: Any) -> float:
    if not (is_real(value) and 0 < value < 1):
        raise bad_value(name, value, "a number in (0, 1)")
    return float(value)


def growth_value(name: str, value: Any) -> float:
    if not (is_real(value) and value > 1):
        raise bad_value(name, value, "a number > 1")
    return float(value)


@dataclass
class PreserverOptions:
    """The guard of DeFT's delayed updates ([DeFT] §IV, `commsched.Preserver`): on by default, so that
    `Trainer(strategy="deft")`, `DeFTStrategy()` and Hydra's `schedule=deft` run the same guarded
    plans. A `commsched.Preserver` in the Trainer's callbacks is used instead of these settings."""

    enabled: bool = option(True, flag)
    """False: plans run unguarded (a warning says what a delayed plan then risks)."""
    eps: float = option(0.01, eps_value)
    """Accept a plan when E(loss) after it over E(loss) after synchronous steps is within [1-eps, 1+eps]."""
    max_tries: int = option(10, positive_int)
    """Plans solved at most (capacity x growth each time); after them, no delay."""
    growth: float = option(1.25, growth_value)
    """Capacity growth between tries: small steps keep as much overlap as the walk allows."""
    max_staleness: int = option(0, non_negative_int)
    """Reject plans whose generations step more iterations than this after their last gradient. 0 (the
    default): no stale update. 1: a one-iteration-stale plan is accepted where it was measured to keep
    accuracy: under SGD with momentum >= 0.9, with the spike compensation and weight prediction that
    `deft.compensation="auto"` picks for it (within 0.6 points of synchronous on two BatchNorm networks,
    but 17-24 points below it on a VGG-16 with BatchNorm at lr 0.05: see docs/deft.md)."""
    curvature_margin: float = option(0.0, non_negative_number)
    """> 0: a stale plan within `max_staleness` that was not measured to keep accuracy is accepted
    where the optimizer, compensated as it runs, stays stable on the loss's top curvature times this
    margin (`deft/stability.py`; measured by Hessian-vector power iteration on probe steps). 0: no
    curvature measured."""
    watch_steps: int = option(10, non_negative_int)
    """A stale plan that runs is watched for this many iterations: if their mean training loss (averaged
    over every rank) is not below that of as many iterations before it, the plan is stopped, stale plans
    are refused for the rest of the run, and DeFT measures and solves again (an exact plan or schedule).
    0: not watched. Measured on the single-process reference from one epoch at lr 0.05 (docs/deft.md):
    ResNet-18 and a small BatchNorm net end within 0.1 point of synchronous training over 200+ seeds,
    but VGG-16-BN loses 4 points on average: the watch kept 13 of 77 plans whose harm shows only later."""
    rollback: bool = option(True, flag)
    """When the watch stops a plan: True, the weights, buffers and optimizer state go back to where it
    started and its iterations are dropped (one more copy of the model and optimizer state in host memory
    while watching, saved in checkpoints); False, what is in flight is applied and training goes on."""
    stale_after_steps: Optional[int] = option(None, optional(non_negative_int))
    """No stale plan runs before this many steps of training: DeFT runs an exact plan until then, and
    measures and solves again at that step. Unset (null): one epoch (200 steps where the training loader
    has no length). Staleness harms most in the first steps, and there the loss falls fast whatever runs,
    so the watch cannot tell a harmful plan (docs/deft.md)."""
    recheck_every_n_steps: int = option(0, non_negative_int)
    """> 0: measure and solve again every N steps."""


def check_preserver_settings(
    eps: float, max_tries: int, growth: float, prefix: str = "Preserver."
) -> tuple[float, int, float]:
    """The Preserver's own arguments, checked as `PreserverOptions` checks its fields."""
    return (
        eps_value(f"{prefix}eps", eps),
        positive_int(f"{prefix}max_tries", max_tries),
        growth_value(f"{prefix}growth", growth),
    )
