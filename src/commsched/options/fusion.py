"""Options of bucket fusion: the policy that decides which gradients share a bucket, the
bucket-size search, and the profiler the planners read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from commsched.errors import bad_value
from commsched.options.catalogue import FUSION_POLICIES
from commsched.options.validators import (
    choice,
    flag,
    non_negative_int,
    non_negative_number,
    one_of,
    option,
    optional,
    positive_int,
    positive_number,
    text,
    typed,
)


@dataclass
class TuningOptions:
    """Bayesian optimisation of the bucket size (``fusion.policy="bayes"``)."""

    trials: int = option(10, positive_int)
    """Trial budget: bucket sizes measured before the best is kept."""
    warmup_steps: int = option(2, non_negative_int)
    """Steps left out at the start of each trial (the rebuild and first steps are slower)."""
    trial_steps: int = option(10, positive_int)
    """Steps timed per trial; the median counts."""
    min_mb: float = option(1.0, positive_number)
    """Smallest bucket size searched (MB). Lower it for models with only a few MB of gradients."""
    max_mb: float = option(100.0, positive_number)
    """Largest bucket size searched (MB)."""
    first_mb: float = option(25.0, positive_number)
    """The first trial's size (MB); DDP's default."""
    xi: float = option(0.1, positive_number)
    """Expected Improvement's exploration parameter."""

    def cross_check(self, prefix: str) -> None:
        if not self.min_mb <= self.first_mb <= self.max_mb:
            raise bad_value(
                f"{prefix}first_mb",
                self.first_mb,
                f"a size within {prefix}min_mb..{prefix}max_mb ({self.min_mb}..{self.max_mb})",
            )


@dataclass
class FusionOptions:
    """Which gradients share a bucket, and how that is decided."""

    policy: str = option("auto", one_of(*FUSION_POLICIES))
    """auto | fixed | layers | mgwfbp | mgwfbp-greedy | dear-model | bayes (see docs/fusion.md). auto:
    the schedule's own planner plans from the first steps, and its plan is kept only if measured faster
    than fixed buckets on real steps."""
    bucket_cap_mb: float = option(25.0, positive_number)
    """fixed: a bucket closes before the next tensor would pass this many MB (the first at 1 MiB, as DDP);
    the model planners profile on these buckets."""
    bucket_layers: int = option(1, positive_int)
    """layers: consecutive layers (modules owning parameters) per bucket."""
    profile_steps: int = option(5, positive_int)
    """Model planners: steps profiled before rank 0 plans (on a GPU twice as many: steps timed layer by
    layer alternate with steps timed whole)."""
    profile_warmup_steps: int = option(5, non_negative_int)
    """Model planners: steps left out before those (a CPU run's first steps are up to 2x slower)."""
    confirm_steps: int = option(3, positive_int)
    """auto: timed steps per turn when fixed and planned buckets take turns (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """auto: turns each layout takes before the measured steps may overrule the model (steps that agree with it
    decide after two)."""
    confirm_max_rounds: int = option(6, positive_int)
    """auto: turns each layout may take in all when the steps lean against the model's choice within their
    noise (more turns until the difference is resolved; at least `confirm_rounds`)."""
    drift: float = option(0.2, non_negative_number)
    """auto: a median step this much slower than the kept layout measured (0.2: 20%) decides again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """auto: steps per median watched for drift."""
    plan_file: Optional[str] = option(None, optional(text))
    """A saved plan (commsched-plan, or a run's commsched_plan.json): used from the first step, no planning."""


@dataclass
class ProfileOptions:
    """The in-run profiler: per-layer, per-bucket and per-link times of the first steps."""

    steps: int = option(0, non_negative_int)
    """Profile the first N training steps (0: off); writes profile.json and a Chrome trace.json. On a
    GPU the N - 1 after the first are doubled: steps timed layer by layer alternate with steps timed whole."""
    dir: Optional[str] = option(None, optional(text))
    """Where the profile goes (default: commsched_profile/ in the run's folder: the logger's, else default_root_dir)."""
    probe: bool = option(False, flag)
    """Also fit every link's alpha-beta costs when profiling ends."""


def fusion_from(fusion: Any, bucket_cap_mb: Optional[float]) -> FusionOptions:
    """The strategy's `fusion=` (a policy name or options) with the `bucket_cap_mb=` shorthand applied
    (validated with the other concerns: `options.strategy.check_concerns`)."""
    options = (
        FusionOptions(policy=choice("fusion", fusion, FUSION_POLICIES))
        if isinstance(fusion, str)
        else typed("fusion", fusion, FusionOptions)
    )
    if bucket_cap_mb is not None:
        options = dataclasses.replace(options, bucket_cap_mb=positive_number("bucket_cap_mb", bucket_cap_mb))
        if fusion == "auto":  # DDP's one knob, set: the user chose their buckets
            options = dataclasses.replace(options, policy="fixed")
    return options


def profile_from(profile: Any) -> ProfileOptions:
    """The strategy's `profile=`: `ProfileOptions` (None: its defaults, which profile nothing)."""
    return typed("profile", ProfileOptions() if profile is None else profile, ProfileOptions)
