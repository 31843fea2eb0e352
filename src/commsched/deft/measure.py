"""What DeFT solves from, measured in the run: stage times of synchronous steps and each bucket's
all-reduce time on each link (and, to compare with DeAR, its reduce-scatter and all-gather),
agreed by every rank (the slowest rank's figure counts)."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from commsched.comm.buckets import BucketPlan
from commsched.comm.device_time import Stopwatch, median_seconds, synchronize
from commsched.comm.links import Link
from commsched.deft.plan import Timings
from commsched.errors import CommSchedConfigError, bad_value
from commsched.reducers import ShardedReduce


class StageMeter:
    """Per measured iteration: forward seconds and when each bucket became ready in backward (on
    CUDA each mark waits for the device: measured steps time the kernels, not their launch)."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.forward: list[float] = []
        self.ready: list[list[float]] = []
        self._device = device
        self._started = 0.0
        self._backward_started = 0.0

    def _now(self) -> float:
        synchronize(self._device)
        return time.perf_counter()

    def forward_started(self) -> None:
        self._started = self._now()

    def forward_done(self) -> None:
        now = self._now()
        self.forward.append(now - self._started)
        self._backward_started = now
        self.ready.append([])

    def bucket_ready(self) -> None:
        if self.ready:
            self.ready[-1].append(self._now() - self._backward_started)

    def forget_last(self) -> None:
        """Leave the last iteration out of the figures (its backward also measured the curvature)."""
        if self.forward:
            self.forward.pop()
            self.ready.pop()

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


SHARED = 1.5  # loaded / alone above this on every link: the links share one network


def all_reduce_seconds(
    plan: BucketPlan, links: list[Link], control: Link, repeats: int
) -> tuple[list[list[float]], bool]:
    """costs[link][bucket] and whether the links share one network. Each bucket's all-reduce is timed
    on each link alone and **under load** (every link running the same all-reduce at the same time,
    each timed to its own completion); the medians of `repeats`, the slowest rank's figures. Links on
    separate networks show the same times both ways and the loaded ones are used. Two groups on one
    network slow each other down (about twice the time each): a second group adds no bandwidth there,
    so the secondary is left out (its cost infinite) and the primary's times alone are used."""
    alone = [[_median_seconds_together([link], [bucket], repeats)[0] for bucket in plan.buckets] for link in links]
    loaded_by_bucket = [_median_seconds_together(links, [bucket] * len(links), repeats) for bucket in plan.buckets]
    loaded = [[per_bucket[i] for per_bucket in loaded_by_bucket] for i in range(len(links))]
    n = len(plan.buckets)
    flat = max_over_ranks([c for costs in (*alone, *loaded) for c in costs], control, "deft-cost-max")
    alone = [flat[i * n : (i + 1) * n] for i in range(len(links))]
    loaded = [flat[(len(links) + i) * n : (len(links) + i + 1) * n] for i in range(len(links))]
    shared = all(sum(l) > SHARED * sum(a) for l, a in zip(loaded, alone))
    if shared:
        return [alone[0], *([math.inf] * n for _ in links[1:])], True
    return loaded, False


def _median_seconds_together(links: list[Link], buckets: list, repeats: int) -> list[float]:
    """Per link, the median time from starting the same all-reduce on all of them to its completion
    (`Stopwatch`: the transfer's completion on the link's device, not the launch)."""
    scratch = [
        torch.zeros_like(
            bucket.buffer, device=link.device, dtype=link.wire_for(bucket.buffer.dtype)
        )  # as `comm_dtype` sends
        for link, bucket in zip(links, buckets)
    ]
    for link, tensor in zip(links, scratch):
        link.all_reduce(tensor, "deft-cost-warmup").wait()
    times: list[list[float]] = [[] for _ in links]
    for _ in range(repeats):
        for link in links:
            link.synchronize()
        watches = [Stopwatch(link.device) for link in links]
        works = [link.all_reduce(tensor, "deft-cost") for link, tensor in zip(links, scratch)]
        for watch, work in zip(watches, works):
            watch.stop_when(work)
        for work in works:
            work.wait()
        for index, watch in enumerate(watches):
            times[index].append(watch.seconds)
    return [statistics.median(t) for t in times]


def halves_seconds(plan: BucketPlan, link: Link, control: Link, repeats: int) -> tuple[list[float], list[float]]:
    """Per bucket, DeAR's two halves on `link` alone (reduce-scatter, all-gather; the medians of
    `repeats`, the slowest rank's): on gloo they are point-to-point exchanges whose cost is not half
    an all-reduce's, so they are timed, not derived."""
    halves: list[list[float]] = [[], []]
    for bucket in plan.buckets:
        reducer = ShardedReduce(torch.zeros_like(bucket.buffer, device=link.device), link)
        for half, launch in zip(halves, (reducer.scatter, reducer.gather)):
            launch("deft-halves-warmup").wait()  # warmed up under its own tag, so no timed warm-up below
            half.append(median_seconds(lambda: launch("deft-halves").wait(), repeats, warmup=0, device=link.device))
    flat = max_over_ranks(halves[0] + halves[1], control, "deft-halves-max")
    n = len(plan.buckets)
    return flat[:n], flat[n:]


def max_over_ranks(values: list[float], control: Link, tag: str) -> list[float]:
    """Each value's maximum over the ranks (blocking): what every rank then solves from."""
    agreed = control.tensor(values, torch.float64)
    control.all_reduce(agreed, tag, op=dist.ReduceOp.MAX).wait()
    return agreed.tolist()


def agreed_stage_times(forward: float, backward: list[float], control: Link) -> tuple[float, list[float]]:
    """The slowest rank's stage times (the knapsacks must hold on every rank)."""
    flat = max_over_ranks([forward, *backward], control, "deft-stage-max")
    return flat[0], flat[1:]


def check_timings_file(path: str) -> None:
    """What can be checked before the model's buckets are counted, so that `commsched-train` refuses a
    bad file before any worker starts: it is a timings file, every time in it seconds >= 0."""
    load_timings(path, None)
    load_halves(path, None)


def load_timings(path: str, buckets: Optional[int]) -> Timings:
    """Per-bucket times from a JSON file: {"forward": s, "backward": [s per bucket], "costs": [[primary], [secondary]]}
    (`buckets`: how many the model has; None: any number, the same on every link)."""
    data = _read(path)
    try:
        timings = Timings(
            float(data["forward"]),
            [float(x) for x in data["backward"]],
            [[float(x) for x in per_link] for per_link in data["costs"]],
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise _not_timings(path, exc) from exc
    expected = len(timings.backward) if buckets is None else buckets
    if len(timings.backward) != expected or len(timings.costs) != 2 or any(len(c) != expected for c in timings.costs):
        if buckets is None:
            raise CommSchedConfigError(
                f"commsched deft: deft.timings_file={path!r} must give as many costs on each of "
                "the 2 links as backward times (one per bucket)"
            )
        raise CommSchedConfigError(
            f"commsched deft: deft.timings_file={path!r} must give {buckets} bucket(s) of backward "
            f"times and of costs on each of the 2 links (this model has {buckets} bucket(s))"
        )
    return timings


def load_halves(path: str, buckets: Optional[int]) -> Optional[tuple[list[list[float]], list[list[float]]]]:
    """DeAR's halves from the same file, if it gives them: "reduce_scatter" and "all_gather", each
    [[primary], [secondary]] or [[primary]] per bucket (None: the file decides the plan alone)."""
    data = _read(path)
    if "reduce_scatter" not in data and "all_gather" not in data:
        return None
    try:
        halves = tuple(
            [[float(x) for x in per_link] for per_link in data[key]] for key in ("reduce_scatter", "all_gather")
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise _not_timings(path, exc) from exc
    expected = len(halves[0][0]) if buckets is None and halves[0] else buckets
    if any(not 1 <= len(h) <= 2 or any(len(c) != expected for c in h) for h in halves) or len(halves[0]) != len(
        halves[1]
    ):
        count = "the same number of" if buckets is None else str(buckets)
        raise CommSchedConfigError(
            f"commsched deft: deft.timings_file={path!r}: reduce_scatter and all_gather must each give "
            f"{count} time(s) per link for the same 1 or 2 links"
        )
    return halves[0], halves[1]


def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise _not_timings(path, exc) from exc
    if not isinstance(data, dict):
        raise _not_timings(path, TypeError("not a JSON object"))
    _check_seconds(path, data)
    return data


TIMED = ("forward", "backward", "costs", "reduce_scatter", "all_gather")
"""The keys of a timings file that hold seconds."""


def _check_seconds(path: str, data: dict) -> None:
    """Every time in the file must be a finite number of seconds >= 0: Python's json reads a bare NaN
    or Infinity (not JSON) and 1e999 as infinity, and a plan solved from any of them, or from a
    negative time, would be nonsense. The refusal names the key, e.g. ``backward[2]``."""
    for key in TIMED:
        if key in data:
            found = _bad_seconds(data[key], key)
            if found is not None:
                raise bad_value(
                    "deft.timings_file",
                    path,
                    f"a timings file whose {found[0]} is a finite number of seconds >= 0, not {_spelled(found[1])}",
                )


def _bad_seconds(value: object, key: str) -> Optional[tuple[str, object]]:
    """The first number under `key` that is NaN, infinite or negative, and where it is."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _bad_seconds(item, f"{key}[{index}]")
            if found is not None:
                return found
        return None
    try:  # what the loaders' float() makes of it, a string such as "NaN" too
        seconds = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        seconds = None  # not a number at all: the loaders refuse its shape
    if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
        return key, value
    return None


def _spelled(value: object) -> str:
    """NaN and Infinity as the file spells them, not Python's nan and inf."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return repr(value)


def _not_timings(path: str, exc: BaseException) -> CommSchedConfigError:
    return CommSchedConfigError(
        f"commsched deft: deft.timings_file={path!r} is not a timings file ({exc}); expected "
        '{"forward": s, "backward": [s per bucket], "costs": [[s per bucket], [s per bucket]]} and '
        'optionally "reduce_scatter", "all_gather" ([[s per bucket] per link])'
    )
