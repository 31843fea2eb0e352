"""Measurement: per-layer and per-bucket times, the link probe, and the in-run profiler."""

from commsched.profile.collectives import COLLECTIVES, time_buckets, time_collective
from commsched.profile.layers import LayerTimer
from commsched.profile.probe import DEFAULT_SIZES, fit_line, probe_link
from commsched.profile.run_profiler import RunProfiler, theoretical_best

__all__ = [
    "COLLECTIVES", "DEFAULT_SIZES", "LayerTimer", "RunProfiler", "fit_line", "probe_link", "theoretical_best",
    "time_buckets", "time_collective",
]
