"""`fusion="auto"`, the default: buckets planned for the model at hand, kept only when measured faster.

Fixed 25 MB buckets (DDP's default) make a model of a few tens of MB one or two buckets, and then
nothing overlaps; the planners know better, but a plan is a model's prediction. So the run decides
from its own steps, every one of them a normal training step:

1. profile: `profile_warmup_steps` steps, then `profile_steps` profiled ones (twice as many on a GPU),
   on fixed buckets;
2. plan: rank 0 plans with the schedule's own planner (`Schedule.planner`: MG-WFBP's programme for
   all-reduce schedules, the DeAR model for DeAR and DeFT) and every rank receives the plan;
3. confirm: the same model predicts the fixed layout too; fixed and planned buckets take turns on
   real steps (`commsched.interleaved`), and the layout the model favours is kept unless the steps
   contradict it beyond their noise (fixed, the default, when the model predicts no clear gain);
4. check again: after 500 and 5,000 more steps the two take longer turns and the verdict may change;
   a median step more than `drift` slower than the kept layout measured re-opens the decision.

One process, or a plan that is the fixed layout anyway, decides at once with no confirmation.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

from commsched.interleaved import Comparison, DriftCheck, Rechecks, Verdict
from commsched.options import FusionOptions
from commsched.planning.plan_file import SavedPlan


class FusionPhase(enum.Enum):
    PROFILE = "profile"
    CONFIRM = "confirm"
    DECIDED = "decided"


FIXED, PLANNED = 0, 1
FUSION_RECHECKS = ((400, 3), (4000, 6))
"""The layout is checked again a hundred steps before the schedule's own choices are (500 and 5,000
steps after theirs, which come later): two checks never time the same steps."""


class AutoFusion:
    """The state of one automatic decision; `commsched.planning.policy.PlanPolicy` drives it at
    iteration starts (every rank at the same ones) and rebuilds the buckets when it says so."""

    def __init__(self, fusion: FusionOptions, planner: str) -> None:
        self.fusion = fusion
        self.planner = planner
        self.phase = FusionPhase.PROFILE
        self.candidate: Optional[SavedPlan] = None
        self.arm = FIXED
        self.turns: Optional[Comparison] = None
        self.rechecks = Rechecks(FUSION_RECHECKS)
        self.verdict: Optional[Verdict] = None
        self.steps_deciding = 0
        self._stale_profile: Any = None
        self._drift: Optional[DriftCheck] = None

    @property
    def wants_profile(self) -> bool:
        return self.phase is FusionPhase.PROFILE

    def fresh_profile(self, profile: Any) -> Any:
        """The profile to plan from: one taken since this decision (re-)opened, else None."""
        return profile if profile is not None and profile is not self._stale_profile else None

    def start_confirming(self, candidate: SavedPlan, turn_factor: int = 1) -> None:
        """Fixed and `candidate` buckets take turns from the next iteration start on (each turn
        `turn_factor` times `confirm_steps`: longer for a later check)."""
        self.candidate = candidate
        self.phase = FusionPhase.CONFIRM
        fixed_s, planned_s = candidate.details.get("fixed_predicted_s"), candidate.predicted_s
        predicted = [fixed_s, planned_s] if fixed_s and planned_s else None
        self.turns = Comparison(
            2,
            self.fusion.confirm_steps * turn_factor,
            self.fusion.confirm_rounds,
            predicted,
            self.fusion.confirm_max_rounds,
        )

    def recheck_due(self) -> bool:
        """After a measured verdict, at every iteration start: True when a later check starts now."""
        if self.verdict is None or self.candidate is None:
            return False
        factor = self.rechecks.due()
        if factor:
            self.start_confirming(self.candidate, factor)
        return bool(factor)

    def next_arm(self) -> Optional[int]:
        """While confirming: the arm to switch to at this iteration start (None: stay)."""
        assert self.turns is not None
        arm = self.turns.at_boundary()
        if arm is None or arm == self.arm:
            return None
        self.arm = arm
        return arm

    def conclude(self, control: Any) -> Optional[Verdict]:
        """Every rank: the verdict on the slowest rank's step times (a collective on `control`); None:
        the steps lean against the model within their noise, and more turns were added."""
        assert self.turns is not None
        verdict = self.turns.conclude(control)
        if verdict is None:
            return None
        self.verdict = verdict
        self.steps_deciding += verdict.steps
        self.phase, self.turns = FusionPhase.DECIDED, None
        self._drift = DriftCheck(self.verdict.medians_s[self.verdict.keep], self.fusion.drift, self.fusion.drift_steps)
        return self.verdict

    def decided_without_confirming(self) -> None:
        """Nothing to compare (one process, a compiled or sparse run, a plan equal to the fixed layout):
        turns a later check had started end too, or the run would count as comparing for good."""
        self.phase, self.turns = FusionPhase.DECIDED, None

    def drifted(self, control: Any) -> bool:
        """After a measured decision: True (every rank at once) when steps drifted slower than the kept layout
        measured."""
        return self._drift is not None and self._drift.at_boundary(control)

    def reopen(self, profile: Any) -> None:
        self.phase, self.arm, self.candidate, self.verdict, self._drift = FusionPhase.PROFILE, FIXED, None, None, None
        self.rechecks, self.turns = Rechecks(FUSION_RECHECKS), None
        self._stale_profile = profile

    def state_dict(self, fixed: Optional[SavedPlan]) -> Optional[dict[str, Any]]:
        """A measured decision as a checkpoint keeps it (None before one): the verdict, both layouts
        (a later check compares them again), and where the later checks stand. Turns under way are
        not kept: a check the checkpoint caught is made again after the resume."""
        if self.verdict is None or self.candidate is None or fixed is None:
            return None
        return {
            "verdict": self.verdict.to_json(),
            "rechecks": self.rechecks.state_dict(checking=self.turns is not None),
            "steps_deciding": self.steps_deciding,
            "candidate": vars(self.candidate),
            "fixed": vars(fixed),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> SavedPlan:
        """Take a checkpoint's measured decision; returns the fixed layout it was measured against."""
        self.verdict = Verdict.from_json(saved["verdict"])
        self.candidate = SavedPlan.from_dict(saved["candidate"])
        self.phase, self.arm, self.turns = FusionPhase.DECIDED, self.verdict.keep, None
        self.rechecks.load_state_dict(saved.get("rechecks", {}))
        self.steps_deciding = int(saved.get("steps_deciding", 0))
        self._drift = DriftCheck(self.verdict.medians_s[self.verdict.keep], self.fusion.drift, self.fusion.drift_steps)
        return SavedPlan.from_dict(saved["fixed"])

    def describe(self) -> str:
        """How the kept layout was chosen, for the log and the closing summary."""
        if self.verdict is None:
            return f"{self.planner}'s plan is the fixed layout" if self.phase is FusionPhase.DECIDED else "deciding"
        names = (f"fixed {self.fusion.bucket_cap_mb:.3g} MB buckets", f"{self.planner}'s plan")
        checked = f", checked again {self.rechecks.done} time(s)" if self.rechecks.done else ""
        return f"{self.verdict.describe(names)} (decided after {self.steps_deciding} steps{checked})"
