"""The registry of schedules, and the strategy Lightning knows each by.

`register_schedule(cls)` is the one step that makes a schedule usable: it goes into
`commsched.SCHEDULES` (which Hydra's ``schedule=``, the profiler and the bench read), gets a
strategy class registered with Lightning under its name, so ``Trainer(strategy="name")`` works,
and hands its `simulate` to the simulator. `import commsched` registers the built-in ones; the named classes are
for explicit configuration, e.g. ``commsched.DeARStrategy(bucket_cap_mb=10)``.
"""

from __future__ import annotations

import dataclasses

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from commsched.comm.link_groups import KNOWN_LINKS
from commsched.comm.links import KNOWN_COLLECTIVES
from commsched.errors import CommSchedConfigError
from commsched.fusion import MODEL_POLICIES
from commsched.runtime.builtin_strategies import (
    BUILTIN_FABRIC_STRATEGIES,
    BUILTIN_STRATEGIES,
    DeARStrategy,
    DeFTStrategy,
    WFBPStrategy,
)
from commsched.runtime.fabric_strategy import CommSchedFabricStrategy
from commsched.runtime.strategy import CommSchedStrategy
from commsched.schedules import SCHEDULES, Schedule
from commsched.sim.simulate import register as register_simulation

STRATEGIES: dict[str, type[CommSchedStrategy]] = {}
"""The strategy class of every registered schedule, by name."""
FABRIC_STRATEGIES: dict[str, type[CommSchedFabricStrategy]] = {}
"""The Fabric strategy class of every registered schedule, by name."""

RESERVED = ("ddp", "base")  # Lightning's own DDP keeps its name; "base" is the abstract class's


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Make `cls` available by its `name` everywhere (usable as a class decorator). Registering a
    name again replaces the earlier schedule (a script re-run by Lightning's launcher registers again)."""
    if not (isinstance(cls, type) and issubclass(cls, Schedule)):
        raise CommSchedConfigError(f"commsched.register_schedule: {cls!r} is not a subclass of commsched.Schedule")
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
        raise CommSchedConfigError(
            f"commsched.register_schedule: {cls.__name__}.name = {name!r}: a Python identifier "
            f"other than {', '.join(RESERVED)} (each schedule sets its own `name`)"
        )
    for field, names, known in (
        ("step_collectives", cls.step_collectives, KNOWN_COLLECTIVES),
        ("links_used", cls.links_used, KNOWN_LINKS),
        ("planner", (cls.planner,), MODEL_POLICIES),
    ):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise CommSchedConfigError(
                f"commsched.register_schedule: {cls.__name__}.{field} has {unknown}; allowed: {', '.join(known)}"
            )
    refuse_options_class(cls)
    missing = [hook for hook in ("on_bucket_ready", "on_backward_end") if getattr(cls, hook) is getattr(Schedule, hook)]
    if missing:
        raise CommSchedConfigError(
            f"commsched.register_schedule: {cls.__name__} does not implement {' and '.join(missing)}: "
            "every schedule says what happens when a bucket is full and when backward ends"
        )
    builtin = BUILTIN_STRATEGIES.get(name)
    if builtin is not None and _BUILTIN_SCHEDULES.get(name) is cls:
        STRATEGIES[name], FABRIC_STRATEGIES[name] = builtin, BUILTIN_FABRIC_STRATEGIES[name]
    elif SCHEDULES.get(name) is not cls or name not in STRATEGIES:
        made = cls.__name__.removesuffix("Schedule")
        body = {"default_schedule": name, "__doc__": cls.description or cls.__doc__, "__module__": __name__}
        STRATEGIES[name] = type(f"{made}Strategy", (CommSchedStrategy,), body)
        FABRIC_STRATEGIES[name] = type(f"{made}FabricStrategy", (CommSchedFabricStrategy,), body)
    SCHEDULES[name] = cls
    register_simulation(name, cls.simulate)
    StrategyRegistry.register(name, STRATEGIES[name], description=cls.description, override=True)
    FABRIC_STRATEGY_REGISTRY.register(name, FABRIC_STRATEGIES[name], description=cls.description, override=True)
    return cls


def refuse_options_class(cls: type[Schedule]) -> None:
    """A schedule's own options must be a dataclass whose every field has a default: the strategy and
    ``commsched-train`` build it with no arguments when the user sets none."""
    options_class = cls.options_class
    if options_class is None:
        return
    if not (isinstance(options_class, type) and dataclasses.is_dataclass(options_class)):
        raise CommSchedConfigError(
            f"commsched.register_schedule: {cls.__name__}.options_class = {options_class!r}: "
            "a dataclass (a default and a docstring per field), or None"
        )
    builder = next(c for c in cls.__mro__ if "settings_for" in vars(c))
    if builder is not Schedule and builder.options_class is not options_class:
        raise CommSchedConfigError(
            f"commsched.register_schedule: {cls.__name__}.options_class {options_class.__name__} would "
            f"never reach the schedule: the settings_for it inherits from {builder.__name__} builds "
            f"{builder.__name__}'s own settings. Override settings_for (options.schedule_options "
            "holds the validated instance)"
        )
    required = [
        f.name
        for f in dataclasses.fields(options_class)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if required:
        raise CommSchedConfigError(
            f"commsched.register_schedule: {cls.__name__}.options_class {options_class.__name__} "
            f"has fields without a default ({', '.join(required)}): give each one"
        )


_BUILTIN_SCHEDULES = dict(SCHEDULES)
for _builtin in list(SCHEDULES.values()):
    STRATEGIES.pop(_builtin.name, None)
    register_schedule(_builtin)

__all__ = ["DeARStrategy", "DeFTStrategy", "FABRIC_STRATEGIES", "STRATEGIES", "WFBPStrategy", "register_schedule"]

for _registry, _wfbp in (
    (StrategyRegistry, WFBPStrategy),
    (FABRIC_STRATEGY_REGISTRY, BUILTIN_FABRIC_STRATEGIES["wfbp"]),
):
    _registry.register(
        "topk",
        _wfbp,
        description="commsched WFBP with top-k sparse exchanges (density 0.01, "
        "error feedback; the faster selection, and dense where sparse does not pay)",
        override=True,
        compression="auto",
    )
