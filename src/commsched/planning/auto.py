"""`fusion="auto"`, the default: buckets planned for the model at hand, kept only when measured faster.

Fixed 25 MB buckets (DDP's default) make a model of a few tens of MB one or two buckets, and then
nothing overlaps; the planners know better, but a plan is a model's prediction. So the run decides
from its own steps, every one of them a normal training step:

1. profile: `profile_warmup_steps` steps, then `profile_steps` profiled ones, on fixed buckets;
2. plan: rank 0 plans with the schedule's own planner (`Schedule.planner`: MG-WFBP's programme for
   all-reduce schedules, the DeAR model for DeAR and DeFT) and every rank receives the plan;
3. confirm: fixed and planned buckets take turns on real steps (`commsched.interleaved`); the plan
   is kept only if it beats the fixed layout by more than the measured noise, else fixed stays;
4. watch: a median step more than `drift` slower than the kept layout measured re-opens the decision.

One process, or a plan that is the fixed layout anyway, decides at once with no confirmation.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

from commsched.interleaved import DriftWatch, Turns, Verdict, decide, slowest_rank
from commsched.options import FusionOptions
from commsched.planning.plan_file import SavedPlan


class Phase(enum.Enum):
    PROFILE = "profile"
    CONFIRM = "confirm"
    DECIDED = "decided"


FIXED, PLANNED = 0, 1


class AutoFusion:
    """The state of one automatic decision; `commsched.planning.policy.PlanPolicy` drives it at
    iteration starts (every rank at the same ones) and rebuilds the buckets when it says so."""

    def __init__(self, fusion: FusionOptions, planner: str) -> None:
        self.fusion = fusion
        self.planner = planner
        self.phase = Phase.PROFILE
        self.candidate: Optional[SavedPlan] = None
        self.arm = FIXED
        self.turns: Optional[Turns] = None
        self.verdict: Optional[Verdict] = None
        self.steps_deciding = 0
        self._stale_profile: Any = None
        self._drift: Optional[DriftWatch] = None

    @property
    def wants_profile(self) -> bool:
        return self.phase is Phase.PROFILE

    def fresh_profile(self, profile: Any) -> Any:
        """The profile to plan from: one taken since this decision (re-)opened, else None."""
        return profile if profile is not None and profile is not self._stale_profile else None

    def start_confirming(self, candidate: SavedPlan) -> None:
        """Fixed and `candidate` buckets take turns from the next iteration start on."""
        self.candidate = candidate
        self.phase = Phase.CONFIRM
        self.turns = Turns(arms=2, steps_per_turn=self.fusion.confirm_steps, rounds=self.fusion.confirm_rounds)

    def next_arm(self) -> Optional[int]:
        """While confirming: the arm to switch to at this iteration start (None: stay)."""
        assert self.turns is not None
        arm = self.turns.at_boundary()
        if arm is None or arm == self.arm:
            return None
        self.arm = arm
        return arm

    def conclude(self, control: Any) -> Verdict:
        """Every rank: the verdict on the slowest rank's step times (a collective on `control`)."""
        assert self.turns is not None
        self.verdict = decide(slowest_rank(self.turns.samples(), control), self.turns.steps)
        self.steps_deciding += self.turns.steps
        self.phase, self.turns = Phase.DECIDED, None
        self._drift = DriftWatch(self.verdict.medians_s[self.verdict.keep], self.fusion.drift, self.fusion.drift_steps)
        return self.verdict

    def decided_without_confirming(self) -> None:
        self.phase = Phase.DECIDED

    def watch(self, control: Any) -> bool:
        """After a measured decision: True (every rank at once) when steps drifted slower than the kept layout measured."""
        return self._drift is not None and self._drift.at_boundary(control)

    def reopen(self, profile: Any) -> None:
        self.phase, self.arm, self.candidate, self.verdict, self._drift = Phase.PROFILE, FIXED, None, None, None
        self._stale_profile = profile

    def describe(self) -> str:
        """How the kept layout was chosen, for the log and the closing summary."""
        if self.verdict is None:
            return f"{self.planner}'s plan is the fixed layout" if self.phase is Phase.DECIDED else "deciding"
        v = self.verdict
        fixed_ms, planned_ms = v.medians_s[FIXED] * 1e3, v.medians_s[PLANNED] * 1e3
        measured = (f"{self.planner}'s plan measured {planned_ms:.1f} ms/step against {fixed_ms:.1f} for fixed "
                    f"{self.fusion.bucket_cap_mb:.3g} MB buckets")
        if v.keep == PLANNED:
            return f"{measured} ({v.gain:.2f}x, noise margin {v.margin:.0%}): planned buckets kept after {self.steps_deciding} steps"
        return f"{measured} (noise margin {v.margin:.0%}): fixed buckets kept after {self.steps_deciding} steps"
