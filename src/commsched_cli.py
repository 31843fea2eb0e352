"""Console entry points of commsched: they import the package without torch and Lightning (which
take about 6 s), so that ``--help`` and refused input answer at once; the work itself imports them."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def _run(module: str) -> Any:
    return importlib.import_module(module).main()


def train() -> Any:
    return _run("commsched.train")


def bench() -> Any:
    return _run("commsched.bench.cli")


def probe() -> Any:
    return sys.exit(_run("commsched.profile.probe_cli"))


def simulate() -> Any:
    return sys.exit(_run("commsched.sim.cli"))


def plan() -> Any:
    return sys.exit(_run("commsched.planning.cli"))


def cluster() -> Any:
    return sys.exit(_run("commsched.cluster.cli"))
