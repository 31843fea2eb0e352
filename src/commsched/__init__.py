"""commsched: Lightning strategies that schedule gradient communication.

``import commsched`` registers the strategies with Lightning, so ``Trainer(strategy="dear")`` and
``Trainer(strategy="wfbp")`` and ``Trainer(strategy="deft")`` work; the classes and options are exported for explicit
configuration, e.g. ``Trainer(strategy=commsched.DeARStrategy(bucket_cap_mb=10))``. A new schedule is a subclass of
`commsched.Schedule` passed to `commsched.register_schedule`.

``import commsched`` itself imports neither torch nor Lightning: the strategies are registered when
Lightning loads (`commsched.registration`), and the classes load when first used, so the command
lines (`commsched_cli`) answer ``--help`` and bad input at once.
"""

from __future__ import annotations

import importlib
from typing import Any

from commsched.errors import CommSchedConfigError, PeerFailureError, ScheduleError
from commsched.options import (
    CompressionOptions,
    DeAROptions,
    DeFTOptions,
    FusionOptions,
    LinkOptions,
    PreserverOptions,
    ProfileOptions,
    StreamOptions,
    TuningOptions,
)
from commsched.registration import FABRIC, register_entries, register_fabric_entries, when_lightning_loads

__version__ = "0.2.0"

_NEEDS_LIGHTNING = {
    "CommSchedStrategy": "commsched.runtime.strategy",
    "DeARStrategy": "commsched.runtime.builtin_strategies",
    "WFBPStrategy": "commsched.runtime.builtin_strategies",
    "DeFTStrategy": "commsched.runtime.builtin_strategies",
    "register_schedule": "commsched.runtime.registry",
    "STRATEGIES": "commsched.runtime.registry",
    "StopAndSave": "commsched.runtime.interrupt",
    "StoppedBySignal": "commsched.runtime.interrupt",
    "SCHEDULES": "commsched.schedules",
    "Schedule": "commsched.schedules",
    "Handover": "commsched.schedules",
    "Preserver": "commsched.deft.preserver",
    "ResumableDataLoader": "commsched.data.resumable",
    "CommSchedFabricStrategy": "commsched.runtime.fabric_strategy",
    "DeARFabricStrategy": "commsched.runtime.builtin_strategies",
    "WFBPFabricStrategy": "commsched.runtime.builtin_strategies",
    "DeFTFabricStrategy": "commsched.runtime.builtin_strategies",
}


def _register() -> None:
    importlib.import_module("commsched.runtime.registry")  # registers the built-in schedules' strategies with Lightning


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_LIGHTNING:
        raise AttributeError(f"module 'commsched' has no attribute {name!r}")
    _register()
    return getattr(importlib.import_module(_NEEDS_LIGHTNING[name]), name)


when_lightning_loads(register_entries)
when_lightning_loads(register_fabric_entries, FABRIC)

__all__ = [
    "CommSchedConfigError",
    "CompressionOptions",
    "CommSchedFabricStrategy",
    "CommSchedStrategy",
    "DeARFabricStrategy",
    "DeAROptions",
    "DeARStrategy",
    "DeFTFabricStrategy",
    "DeFTOptions",
    "DeFTStrategy",
    "FusionOptions",
    "Handover",
    "LinkOptions",
    "PeerFailureError",
    "Preserver",
    "PreserverOptions",
    "ProfileOptions",
    "ResumableDataLoader",
    "SCHEDULES",
    "STRATEGIES",
    "Schedule",
    "ScheduleError",
    "StopAndSave",
    "StoppedBySignal",
    "StreamOptions",
    "TuningOptions",
    "WFBPFabricStrategy",
    "WFBPStrategy",
    "register_schedule",
]
