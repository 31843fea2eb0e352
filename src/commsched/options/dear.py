"""Options of DeAR: whether WFBP runs the iterations where it measured faster, and the rollback copies."""

from __future__ import annotations

from dataclasses import dataclass

from commsched.options.checks import positive_int, non_negative_number, flag, one_of, option


@dataclass
class DeAROptions:
    """DeAR ([DeAR]): each bucket's all-reduce split into a reduce-scatter in backward and an all-gather
    in the next forward."""

    fallback: str = option("when_faster", one_of("when_faster", "never"))
    """"when_faster": once the buckets are decided, DeAR and WFBP (DDP's schedule: the same math, one
    all-reduce per bucket in backward) take turns on real steps, and WFBP runs the iterations when it
    measured faster beyond the noise (a fast link leaves DeAR nothing to hide, and its two collectives
    per bucket cost more CPU than one); compared again when the steps drift. "never": DeAR always.
    With several streams (`streams`), DeAR always."""
    confirm_steps: int = option(3, positive_int)
    """Timed steps per turn (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """Turns each schedule takes before the measured steps decide."""
    drift: float = option(0.2, non_negative_number)
    """A median step this much slower than the kept schedule measured compares them again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """Steps per median watched for drift."""
    rollback: bool = option(True, flag)
    """A bucket's update applied while later all-gathers of the same step are still on the network
    first copies the bucket's parameters and optimizer state: a run that fails part-way (a peer
    died) takes the step back, so what is saved after the failure is the model before that step,
    whole. Costs the memory of the parameters and optimizer state applied early (allocated once,
    reused every step; none where the all-gathers land before the forward needs them) and the copy
    (within noise where measured). False: no copies, and a failure part-way leaves weights that mix
    two steps (said when it happens)."""
