"""commsched: Lightning strategies that schedule gradient communication.

``import commsched`` registers the strategies with Lightning, so ``Trainer(strategy="dear")`` and
``Trainer(strategy="wfbp")`` work; the classes and options are exported for explicit configuration,
e.g. ``Trainer(strategy=commsched.DeARStrategy(bucket_cap_mb=10))``.
"""

from commsched.errors import CommSchedConfigError, PeerFailureError, ScheduleError
from commsched.observers import reads_no_weights
from commsched.options import FusionOptions, LinkOptions, ProfileOptions, TuningOptions
from commsched.registry import STRATEGIES, DeARStrategy, WFBPStrategy, register_with_lightning
from commsched.schedules import SCHEDULES
from commsched.strategy import CommSchedStrategy

__version__ = "0.2.0"

register_with_lightning()

__all__ = [
    "CommSchedConfigError", "CommSchedStrategy", "DeARStrategy", "FusionOptions", "LinkOptions", "PeerFailureError",
    "ProfileOptions", "SCHEDULES", "STRATEGIES", "ScheduleError", "TuningOptions", "WFBPStrategy", "reads_no_weights",
]
