"""What a test worker says at exit: commsched's issuer threads still alive (none, after any run, also
a failed one: a thread left inside the backend at interpreter exit can abort the process)."""

from __future__ import annotations

import os
import threading


def report_issuer_threads() -> None:
    alive = [t.name for t in threading.enumerate() if t.name.startswith("commsched-issue") and t.is_alive()]
    print(f"commsched-test: rank {os.environ.get('LOCAL_RANK', '0')} issuer threads alive at exit: {alive}", flush=True)
