"""commsched: Lightning strategies that schedule gradient communication.

``import commsched`` registers the strategies with Lightning, so ``Trainer(strategy="dear")`` and
``Trainer(strategy="wfbp")`` work; the classes are exported for explicit configuration, e.g.
``Trainer(strategy=commsched.DeARStrategy(bucket_cap_mb=10))``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from commsched.errors import CommSchedConfigError, PeerFailureError, ScheduleError
from commsched.strategy import CommSchedStrategy, DeARStrategy, WFBPStrategy

__version__ = "0.1.0"

STRATEGIES: dict[str, tuple[type[CommSchedStrategy], str]] = {
    "wfbp": (WFBPStrategy, "commsched WFBP: bucketed all-reduce launched during backward"),
    "dear": (DeARStrategy, "commsched DeAR: reduce-scatter in backward, all-gather overlapped with the next forward"),
}

for _name, (_cls, _description) in STRATEGIES.items():
    StrategyRegistry.register(_name, _cls, description=_description, override=True)

__all__ = [
    "CommSchedConfigError",
    "CommSchedStrategy",
    "DeARStrategy",
    "PeerFailureError",
    "STRATEGIES",
    "ScheduleError",
    "WFBPStrategy",
]
