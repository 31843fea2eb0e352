"""The names the options accept, in one place: schedules, fusion policies, backends, methods.

Torch-free, like every options module: `commsched-train` checks its input with them before torch is
imported. The built-in schedules' traits are read by the schedule classes themselves, so the checks
made here before torch is imported and the registry (`commsched.SCHEDULES`) cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleTraits:
    """What the options checks need to know of a built-in schedule before it is imported."""

    compresses: bool = False
    """Builds sparse exchanges when `compression` asks for them."""
    stripes: bool = False
    """Spreads its buckets' units over several streams."""


BUILTIN: dict[str, ScheduleTraits] = {
    "wfbp": ScheduleTraits(compresses=True, stripes=True),
    "dear": ScheduleTraits(stripes=True),
    "deft": ScheduleTraits(),  # splits its buckets between two links instead
}
"""The built-in schedules (`commsched.SCHEDULES` before any plugin registers more), by name."""
BUILTIN_SCHEDULES = tuple(BUILTIN)
MODEL_POLICIES = ("mgwfbp", "mgwfbp-greedy", "dear-model")  # planned from a profile of the first steps
FUSION_POLICIES = ("auto", "fixed", "layers", *MODEL_POLICIES, "bayes")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl")
FALLBACKS = ("when_faster", "when_undelayed", "never")
COMPRESSION_METHODS = ("none", "auto", "topk", "sampled", "mstopk")
COMPRESSING_SCHEDULES = tuple(name for name, traits in BUILTIN.items() if traits.compresses)
STRIPING_SCHEDULES = tuple(name for name, traits in BUILTIN.items() if traits.stripes)
MAX_STREAMS = 16
COMM_DTYPES = ("fp32", "bf16", "fp16")
"""What gradients travel as (`comm_dtype`): as they are, or cast to a 16-bit float for the collective."""
