"""Two gloo processes: a continuation runs on the backend's thread as soon as its collective completes
(nobody waits), and a second-stage collective it starts on another link completes too."""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from commsched.links import Links, LinkSpec
from commsched.workers import run_workers


def check(rank: int, out: str) -> None:
    links = Links([LinkSpec("primary", "gloo"), LinkSpec("secondary", "gloo")], timedelta(seconds=30), trace=None)
    ran = threading.Event()
    first = torch.full((1000,), float(rank + 1))
    second = torch.zeros(1000)

    def continuation():
        ran.set()
        second.copy_(first)
        return links["secondary"].all_reduce(second, "second-stage")

    pending = links["primary"].all_reduce(first, "first-stage").then(continuation)
    deadline = time.monotonic() + 20
    while not ran.is_set() and time.monotonic() < deadline:  # no wait(): the continuation must run by itself
        time.sleep(0.01)
    assert ran.is_set(), "the continuation did not run when the collective completed"
    pending.wait()
    assert torch.all(first == 3.0) and torch.all(second == 6.0), (first[0], second[0])
    links.destroy()
    if rank == 0:
        Path(out, "ok").write_text("ok")


if __name__ == "__main__":
    run_workers(2, check, sys.argv[1])
