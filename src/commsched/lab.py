"""What the lab needs beyond the library: `pip install commsched` brings the strategies and the
command line that trains with them; the benchmark, the simulator and every plot need
``pip install 'commsched[lab]'`` (matplotlib), and say so in one line when it is missing."""

from __future__ import annotations

import importlib

LAB_PACKAGES = ("matplotlib",)
INSTALL_LAB = "pip install 'commsched[lab]'"


def _missing() -> list[str]:
    """The lab's packages that do not import (not installed, or broken)."""
    missing = []
    for package in LAB_PACKAGES:
        try:
            importlib.import_module(package)
        except ImportError:
            missing.append(package)
    return missing


def has_lab() -> bool:
    return not _missing()


def require_lab(tool: str) -> None:
    """Refuse to start `tool` (a command of the lab) without the lab's packages, naming the extra."""
    missing = _missing()
    if missing:
        raise SystemExit(f"commsched: {tool} needs {', '.join(missing)}, which comes with the lab: {INSTALL_LAB}")


def plot_skipped(what: str) -> str:
    """The line a library path says instead of drawing `what` without the lab."""
    return f"commsched: {what} not drawn: plots need matplotlib ({INSTALL_LAB})"
