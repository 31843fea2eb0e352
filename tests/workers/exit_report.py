"""How a test worker ends: what it says at exit (commsched's issuer threads still alive: none, after any
run, also a failed one, since a thread left inside the backend at interpreter exit can abort the
process), and Lightning's watcher of dead workers slowed so that it does not race the run's own ending."""

from __future__ import annotations

import os
import threading
from functools import partialmethod

from lightning.fabric.strategies.launchers import subprocess_script


def report_issuer_threads() -> None:
    alive = [t.name for t in threading.enumerate() if t.name.startswith("commsched-issue") and t.is_alive()]
    print(f"commsched-test: rank {os.environ.get('LOCAL_RANK', '0')} issuer threads alive at exit: {alive}", flush=True)


def watch_workers_slowly(period_s: int = 60) -> None:
    """Lightning's watcher, a thread of rank 0 that wakes every 5 s, SIGKILLs rank 0 at its first tick
    after a worker died. Rank 0 ends on its own tens of milliseconds after the death, so a tick falling in
    between turns about one case in fifty into a kill at random, whatever commsched does. Workers that test
    commsched's own ending keep the watcher, waking every `period_s`: it still ends a survivor that hangs."""
    observer = subprocess_script._ChildProcessObserver
    observer.__init__ = partialmethod(observer.__init__, sleep_period=period_s)
