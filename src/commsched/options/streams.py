"""Options of several concurrent collective streams, fixed or searched while training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commsched.errors import Either, bad_value
from commsched.options.catalogue import MAX_STREAMS
from commsched.options.validators import (
    flag,
    non_negative_int,
    non_negative_number,
    option,
    positive_int,
    positive_number,
)


def streams_value(name: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STREAMS:
        raise bad_value(name, value, f'an integer 1..{MAX_STREAMS} or "auto"')
    return value


@dataclass
class StreamOptions:
    """Concurrent collectives on several streams ([AIACC] §IV-VI): each bucket is
    sliced into units, unit i goes on stream i mod S (a process group of its own: on NCCL its own
    communicator and CUDA stream), so S transfers share the network at once. One flow often cannot
    fill a cloud link (per-flow caps, one TCP connection per pair in gloo).

    The strategy's ``streams=`` takes these, or ``"auto"`` for ``StreamOptions(count="auto")``."""

    count: Any = option(1, streams_value)
    """1..16 concurrent streams, or "auto": searched on the run's own steps (schedules: wfbp, dear)."""
    unit_mb: float = option(4.0, positive_number)
    """Unit size (MB) with a fixed number of streams; "auto" tunes it."""
    warmup_steps: int = option(5, non_negative_int)
    """count="auto": steps run on one stream before the search starts and left out (a run's first
    steps are slow: measured first, one stream would look worse than it is)."""
    budget_steps: int = option(100, positive_int)
    """count="auto": training steps the search may spend (every one a real training step)."""
    trial_steps: int = option(4, positive_int)
    """Steps run with each configuration the search tries; the first after a switch is left out, the
    median of the others counts."""
    max_streams: int = option(16, positive_int)
    """count="auto": the most streams searched (each link's groups are made as the search first tries
    them, and those the kept configuration does not use are released once it settles)."""
    min_unit_mb: float = option(0.5, positive_number)
    """count="auto": the smallest unit searched (MB)."""
    max_unit_mb: float = option(32.0, positive_number)
    """count="auto": the largest unit searched (MB)."""
    confirm_rounds: int = option(3, positive_int)
    """count="auto": turns the search's best and one stream each take on real steps before the best is
    kept (`trial_steps` steps a turn, the first untimed); kept only if faster beyond the measured noise."""
    window: int = option(25, positive_int)
    """The bandit's sliding window: its last uses of the search techniques."""
    exploration: float = option(0.2, non_negative_number)
    """The bandit's C: weight of exploring a technique used less in the window."""
    drift: float = option(0.2, non_negative_number)
    """After tuning, a median step this much slower than the chosen configuration's measurement (0.2:
    20%) re-opens the search from the best so far. 0: never re-opened."""
    drift_steps: int = option(20, positive_int)
    """Steps per median watched for drift after tuning."""
    retune_steps: int = option(24, positive_int)
    """Budget (steps) of a search re-opened by drift."""
    retune_on_resume: bool = option(False, flag)
    """True: a run resumed from a checkpoint with a decision searches again (default: reuses it)."""
    seed: int = option(0, non_negative_int)
    """The search's random seed (rank 0 decides; every rank follows)."""

    def cross_check(self, prefix: str) -> None:
        if self.max_streams > MAX_STREAMS:
            raise bad_value(f"{prefix}max_streams", self.max_streams, f"an integer 1..{MAX_STREAMS}")
        if self.min_unit_mb > self.max_unit_mb:
            raise bad_value(
                f"{prefix}min_unit_mb", self.min_unit_mb, f"at most {prefix}max_unit_mb ({self.max_unit_mb})"
            )


def streams_from(streams: Any) -> StreamOptions:
    """The strategy's `streams=`: `StreamOptions`, or "auto" (the search at its settings); None: one stream."""
    if streams is None:
        return StreamOptions()
    if streams == "auto":
        return StreamOptions(count="auto")
    if isinstance(streams, StreamOptions):
        return streams
    fix = f"e.g. streams=StreamOptions(count={streams!r})." if isinstance(streams, int) else None
    raise bad_value("streams", streams, 'a commsched.StreamOptions or "auto"', fix=fix)


def check_streams(
    streams: StreamOptions, schedule: str, stripes: bool, compression: Any, fusion_policy: str = "fixed"
) -> None:
    """Several streams only where the schedule stripes its buckets, and on dense exchanges (torch-free)."""
    streams = streams_value("streams.count", streams.count)
    if streams == 1:
        return
    if streams == "auto" and fusion_policy == "bayes":
        raise bad_value(
            "streams.count",
            streams,
            "a fixed number with fusion policy 'bayes': both searches time the same "
            "steps and would read each other's changes as their own",
            fix="tune the bucket size first, then the streams.",
        )
    if not stripes:
        raise bad_value(
            "streams.count",
            streams,
            f"1 with schedule {schedule} (DeFT already splits its buckets between two links)"
            if schedule == "deft"
            else f"1 with schedule {schedule}",
            fix=Either(
                "several streams run on WFBPStrategy and DeARStrategy.",
                "several streams run on schedule=wfbp and schedule=dear.",
            ),
        )
    if compression.method != "none":
        raise bad_value(
            "streams.count",
            streams,
            f"1 with compression method {compression.method!r} (a sparse bucket "
            "is one small all-gather of its largest elements)",
        )
