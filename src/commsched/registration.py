"""Registering commsched's strategies with Lightning when Lightning loads, not when commsched does.

``Trainer(strategy="dear")`` looks the name up in Lightning's `StrategyRegistry`, so the strategies
must be registered before a Trainer is made; but importing Lightning takes seconds, and a script
that imports commsched first (or a command line answering ``--help``) should not pay for it there.
So ``import commsched`` registers at once only where `lightning.pytorch` is already loaded;
otherwise a one-shot import hook registers right after `lightning.pytorch` finishes loading, which
every Trainer needs first. The hook removes itself when it fires.

What it registers is one entry per built-in name whose factory loads the real strategy class when
Lightning first asks for it (`commsched.runtime.registry`, which then registers the classes
themselves): loading them from inside Lightning's import, possibly from inside the import of a
commsched module that imports Lightning, would import commsched modules that are half loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from functools import partial
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

LIGHTNING = "lightning.pytorch"
FABRIC = "lightning.fabric"
TOPK = {"compression": "auto"}
"""``strategy="topk"``: WFBP with `compression="auto"`."""


def register_entries() -> None:
    """Lightning's registry gets each built-in name (the real classes replace these entries when they load)."""
    from lightning.pytorch.strategies import StrategyRegistry

    _register_into(StrategyRegistry, "STRATEGIES")


def register_fabric_entries() -> None:
    """Fabric's registry likewise (``Fabric(strategy="dear")``, with or without `lightning.pytorch` loaded)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    _register_into(STRATEGY_REGISTRY, "FABRIC_STRATEGIES")


def _register_into(registry: Any, classes: str) -> None:
    from commsched.options.catalogue import BUILTIN_SCHEDULES

    for name, params in [*((n, {}) for n in BUILTIN_SCHEDULES), ("topk", TOPK)]:
        if name not in registry:
            registry.register(
                name,
                partial(_strategy, classes, "wfbp" if name == "topk" else name),
                override=True,
                description=f"commsched's {name} strategy (loaded when first used)",
                **params,
            )


def _strategy(classes: str, schedule: str, **options: Any) -> Any:
    import commsched.runtime.registry as registry

    return getattr(registry, classes)[schedule](**options)


def when_lightning_loads(register: Callable[[], None], name: str = LIGHTNING) -> None:
    """`register()` now if the Lightning package `name` is loaded, else right after it is."""
    module = sys.modules.get(name)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            register()
        return  # half loaded (commsched imported from within Lightning's import): registered on first use
    if not any(isinstance(finder, _AfterLoading) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoading(name, register))


class _AfterLoading(importlib.abc.MetaPathFinder):
    """Finds `name` with the other finders, and runs `then()` once its module has executed."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _ThenRun(spec.loader, self.then)
                return spec
        return None


class _ThenRun(importlib.abc.Loader):
    """The module's own loader, then `then()`."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            self.then()
        except Exception as error:  # Lightning itself must still import; the names are registered on first use
            warnings.warn(
                f"commsched: registering the strategies with Lightning failed ({error!r}); "
                "they are registered when a commsched name is first used",
                RuntimeWarning,
                stacklevel=2,
            )

    def __getattr__(self, name: str):  # get_resource_reader, is_package, get_code, ...: the real loader's
        return getattr(self.loader, name)
