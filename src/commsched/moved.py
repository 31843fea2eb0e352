"""Module paths of commsched 0.2.0 that moved into folders by role (runtime/, comm/, cli/, ...):
``import commsched.strategy`` or ``from commsched.links import Link`` still work, with a
DeprecationWarning naming the new path, so scripts written against the old layout keep running.

The old name becomes another name of the same module object (not a copy): ``commsched.strategy is
commsched.runtime.strategy``, so isinstance checks and monkeypatches agree."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

FOLDERS = {
    "runtime": ("strategy", "engine", "registry", "checks", "observers", "interrupt", "buffer_sync", "lr_follow", "callbacks",
                "run_reports", "run_summary"),
    "comm": ("links", "works", "point_to_point", "device_time", "buckets", "peers", "workers"),
    "cli": ("train", "run", "config", "builders", "overrides", "ranks", "sweep", "quiet"),
    "cluster": ("netns",),
    "bench": ("demo",),
    "schedules": ("watch",),
}
"""The folder each module of 0.2.0's package root moved into."""

MOVED = {f"commsched.{name}": f"commsched.{folder}.{name}" for folder, names in FOLDERS.items() for name in names}


class _SameModule(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} moved to {self.new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new name."""

    def is_package(self, fullname: str) -> bool:
        return False

    def get_code(self, fullname: str):
        """For ``python -m commsched.train`` and the like: the new module's code, run as __main__."""
        warnings.warn(f"{self.old} moved to {self.new}: run python -m {self.new}", DeprecationWarning, stacklevel=2)
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)  # type: ignore[union-attr]


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old path's module under its new one."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        moved_to = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(fullname, _SameModule(fullname, new), origin=moved_to.origin if moved_to else None)


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
