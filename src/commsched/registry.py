"""The strategies Lightning knows by name: one per schedule in `commsched.schedules.SCHEDULES`.

`import commsched` registers them, so ``Trainer(strategy="dear")`` works; the named classes are
for explicit configuration, e.g. ``commsched.DeARStrategy(bucket_cap_mb=10)``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from commsched.schedules import SCHEDULES
from commsched.strategy import CommSchedStrategy


class WFBPStrategy(CommSchedStrategy):
    """Bucketed all-reduce launched during backward as buckets fill (DDP's schedule, in the open)."""

    default_schedule = "wfbp"


class DeARStrategy(CommSchedStrategy):
    """DeAR: reduce-scatter during backward, all-gather overlapped with the next forward."""

    default_schedule = "dear"


class DeFTStrategy(CommSchedStrategy):
    """DeFT: delayed updates solved by knapsacks over a primary and a secondary link (``deft=DeFTOptions``)."""

    default_schedule = "deft"


STRATEGIES: dict[str, type[CommSchedStrategy]] = {"wfbp": WFBPStrategy, "dear": DeARStrategy, "deft": DeFTStrategy}


def register_with_lightning() -> None:
    for name, strategy in STRATEGIES.items():
        StrategyRegistry.register(name, strategy, description=SCHEDULES[name].description, override=True)
