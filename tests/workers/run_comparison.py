"""A comparison between two arms on 2 real gloo processes whose own models disagree: each rank's
prediction comes from its own profile (rank 0 predicts the candidate 10% faster, rank 1 20%
slower) and both arms measure the same. Every rank must reach the same verdict, or the ranks would
run different schedules and wait on each other's collectives for ever.

Usage: python run_comparison.py OUT_DIR   (writes verdict.rank<r>.json)
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

from commsched.comm.link_groups import Links, LinkSpec
from commsched.comm.local_workers import run_workers
from commsched.interleaved import Comparison

PREDICTED = {0: [1.0, 0.9], 1: [1.0, 1.2]}


def check(rank: int, out: str) -> None:
    links = Links([LinkSpec("primary", "gloo")], timedelta(seconds=60), [])
    comparison = Comparison(2, steps_per_turn=2, rounds=2, predicted=PREDICTED[rank], max_rounds=2)
    now, verdict = 0.0, None
    while verdict is None:
        comparison.at_boundary(now)
        if comparison.done:
            verdict = comparison.conclude(links.control)
        now += 1.0  # every step of either arm takes one second: only the model can choose
    Path(out, f"verdict.rank{rank}.json").write_text(
        json.dumps({"keep": verdict.keep, "predicted": verdict.predicted_s})
    )


if __name__ == "__main__":
    run_workers(2, check, sys.argv[1])
