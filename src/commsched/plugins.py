"""Modules a user names on a command line (`plugins=[...]`, `--plugins`), imported before anything
else: the schedules they register with `commsched.register_schedule` are then available by name.
Light on purpose: the command lines answer `--help` and bad input without torch. Below every command
line (the simulator's too), so it names no schedule: the names a command line accepts are
`commsched.cli.config.train_schedule_names`."""

from __future__ import annotations

import importlib
import sys
from typing import Iterable, Sequence

from commsched.errors import bad_value


def import_plugins(modules: Iterable[str]) -> None:
    """Import `plugins` (the working directory first on the path, as for a script): the schedules they
    register become available by name. A module that cannot be imported is refused by name."""
    if "" not in sys.path:
        sys.path.insert(0, "")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise bad_value("plugins", module, f"an importable Python module ({error})") from None


def plugins_in(argv: Sequence[str]) -> list[str]:
    """The `plugins=[a,b]` (or `plugins=a`) of a command line, before Hydra has parsed it."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "plugins" and value:
            return [m.strip().strip("'\"") for m in value.strip("[]").split(",") if m.strip()]
    return []
