"""What DeFT solves from, measured in the run: stage times of synchronous steps and each bucket's
all-reduce time on each link, agreed by every rank (the slowest rank's figure counts)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from commsched.buckets import BucketPlan
from commsched.deft.plan import Timings
from commsched.errors import CommSchedConfigError
from commsched.links import Link


class StageMeter:
    """Per measured iteration: forward seconds and when each bucket became ready in backward."""

    def __init__(self) -> None:
        self.forward: list[float] = []
        self.ready: list[list[float]] = []
        self._started = 0.0
        self._backward_started = 0.0

    def forward_started(self) -> None:
        self._started = time.perf_counter()

    def forward_done(self) -> None:
        now = time.perf_counter()
        self.forward.append(now - self._started)
        self._backward_started = now
        self.ready.append([])

    def bucket_ready(self) -> None:
        if self.ready:
            self.ready[-1].append(time.perf_counter() - self._backward_started)

    def per_bucket_backward(self, buckets: int) -> tuple[float, list[float]]:
        """Median forward seconds and median per-bucket backward seconds (gaps between ready times)."""
        complete = [r for r in self.ready if len(r) == buckets]
        if not self.forward or not complete:
            return 0.0, [0.0] * buckets
        gaps = [[r[0]] + [b - a for a, b in zip(r, r[1:])] for r in complete]
        return statistics.median(self.forward), [statistics.median(g[j] for g in gaps) for j in range(buckets)]

    def state(self) -> dict:
        return {"forward": list(self.forward), "ready": [list(r) for r in self.ready]}

    def load(self, saved: dict) -> None:
        self.forward, self.ready = list(saved["forward"]), [list(r) for r in saved["ready"]]


def all_reduce_seconds(plan: BucketPlan, links: list[Link], control: Link, repeats: int) -> list[list[float]]:
    """costs[link][bucket]: the median of `repeats` blocking all-reduces of the bucket's size, the
    slowest rank's (every rank runs the same sequence)."""
    costs = []
    for link in links:
        per_bucket = []
        for bucket in plan.buckets:
            scratch = torch.zeros_like(bucket.buffer, device=link.device)
            link.all_reduce(scratch, "deft-cost-warmup").wait()
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                link.all_reduce(scratch, "deft-cost").wait()
                times.append(time.perf_counter() - started)
            per_bucket.append(statistics.median(times))
        costs.append(per_bucket)
    agreed = control.tensor([c for per_link in costs for c in per_link], torch.float64)
    control.all_reduce(agreed, "deft-cost-max", op=dist.ReduceOp.MAX).wait()
    flat = agreed.tolist()
    n = len(plan.buckets)
    return [flat[i * n:(i + 1) * n] for i in range(len(links))]


def agreed_stage_times(forward: float, backward: list[float], control: Link) -> tuple[float, list[float]]:
    """The slowest rank's stage times (the knapsacks must hold on every rank)."""
    values = control.tensor([forward, *backward], torch.float64)
    control.all_reduce(values, "deft-stage-max", op=dist.ReduceOp.MAX).wait()
    flat = values.tolist()
    return flat[0], flat[1:]


def load_timings(path: str, buckets: int) -> Timings:
    """Per-bucket times from a JSON file: {"forward": s, "backward": [s per bucket], "costs": [[primary], [secondary]]}."""
    try:
        data = json.loads(Path(path).read_text())
        timings = Timings(float(data["forward"]), [float(x) for x in data["backward"]],
                          [[float(x) for x in per_link] for per_link in data["costs"]])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CommSchedConfigError(f"commsched deft: deft.timings_file={path!r} is not a timings file ({exc}); expected "
                                   '{"forward": s, "backward": [s per bucket], "costs": [[s per bucket], [s per bucket]]}') from exc
    if len(timings.backward) != buckets or len(timings.costs) != 2 or any(len(c) != buckets for c in timings.costs):
        raise CommSchedConfigError(f"commsched deft: deft.timings_file={path!r} must give {buckets} bucket(s) of backward "
                                   f"times and of costs on each of the 2 links (this model has {buckets} bucket(s))")
    return timings
