"""The names the options accept, in one place: schedules, fusion policies, backends, methods.

Torch-free, like every options module: `commsched-train` checks its input with them before torch is
imported. The tuples of built-in schedules are tested equal to the registry's (`commsched.SCHEDULES`).
"""

from __future__ import annotations



BUILTIN_SCHEDULES = ("wfbp", "dear", "deft")  # commsched.SCHEDULES before any plugin registers more (tested equal)
MODEL_POLICIES = ("mgwfbp", "mgwfbp-greedy", "dear-model")  # planned from a profile of the first steps
FUSION_POLICIES = ("auto", "fixed", "layers", *MODEL_POLICIES, "bayes")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl")
FALLBACKS = ("when_faster", "when_undelayed", "never")
COMPRESSION_METHODS = ("none", "auto", "topk", "sampled", "mstopk")
COMPRESSING_SCHEDULES = ("wfbp",)  # the built-in schedules whose `Schedule.compresses` is True (tested equal)
STRIPING_SCHEDULES = ("wfbp", "dear")  # the built-in schedules whose `Schedule.stripes` is True (tested equal)
MAX_STREAMS = 16
