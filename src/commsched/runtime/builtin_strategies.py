"""The built-in schedules' strategies, one class each for the Trainer and for Fabric, so an IDE and the API
reference can show them: ``Trainer(strategy=DeARStrategy(...))`` is ``Trainer(strategy="dear")`` with settings,
``Fabric(strategy=DeARFabricStrategy(...))`` is ``Fabric(strategy="dear")``. Each takes every
argument `CommSchedStrategy` takes; only the schedule it runs differs. A schedule registered by a
user gets a class made for it by `commsched.register_schedule`."""

from __future__ import annotations

from commsched.runtime.fabric_strategy import CommSchedFabricStrategy
from commsched.runtime.strategy import CommSchedStrategy


class WFBPStrategy(CommSchedStrategy):
    """Wait-free backpropagation: each bucket's all-reduce starts as soon as backward has filled it, and
    the optimizer steps once all have landed (DDP's schedule, with commsched's fusion planners, streams
    and sparse exchanges)."""

    default_schedule = "wfbp"


class DeARStrategy(CommSchedStrategy):
    """DeAR: each bucket's reduce-scatter runs during backward and its all-gather during the next forward,
    each bucket's update applied as its all-gather lands; the trained model is DDP's. Where the link is
    fast enough that DeAR has nothing to hide, it measures itself against WFBP and runs the faster
    (`DeAROptions.fallback`)."""

    default_schedule = "dear"


class DeFTStrategy(CommSchedStrategy):
    """DeFT: exact by default; with a delay budget (`DeFTOptions.capacity`) it delays some buckets' updates
    by a step or more and spreads them over a primary and a secondary link, with the staleness
    compensated and watched."""

    default_schedule = "deft"


BUILTIN_STRATEGIES: dict[str, type[CommSchedStrategy]] = {
    "wfbp": WFBPStrategy,
    "dear": DeARStrategy,
    "deft": DeFTStrategy,
}


class WFBPFabricStrategy(CommSchedFabricStrategy):
    """Wait-free backpropagation (DDP's schedule, with commsched's planners, streams and sparse exchanges)."""

    default_schedule = "wfbp"


class DeARFabricStrategy(CommSchedFabricStrategy):
    """DeAR: reduce-scatter during backward, all-gather during the next forward; the trained model is DDP's."""

    default_schedule = "dear"


class DeFTFabricStrategy(CommSchedFabricStrategy):
    """DeFT's choice between WFBP, DeAR and its plan over two links (without delay under Fabric)."""

    default_schedule = "deft"


BUILTIN_FABRIC_STRATEGIES: dict[str, type[CommSchedFabricStrategy]] = {
    "wfbp": WFBPFabricStrategy,
    "dear": DeARFabricStrategy,
    "deft": DeFTFabricStrategy,
}
