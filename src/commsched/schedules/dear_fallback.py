"""DeAR or WFBP, chosen by the run: DeAR pays where the link is slow enough that overlapping the
all-gathers with the next forward hides what WFBP leaves exposed; on a fast link both bounds are
forward plus backward, and WFBP (the simpler schedule, DDP's) is kept unless DeAR measures faster.

The model is each schedule's best step for the profiled components ([DeAR] Eq. 7 and 8: WFBP
t_ff + max(t_bp, t_ar), DeAR max(t_ff, t_ag) + max(t_bp, t_rs)), plus what the profile measured
outside them (optimizer, data), the same for both; `commsched.interleaved` confirms it on real steps.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from commsched.interleaved import MeasuredChoice
from commsched.options import DeAROptions

WFBP, DEAR = 0, 1
"""The arms: WFBP (the default) runs the iterations, or DeAR."""
FALLBACK_ARMS = ("wfbp", "dear")


def predicted_steps(profile: Optional[dict[str, Any]]) -> Optional[list[float]]:
    """[WFBP's, DeAR's] best step from a profile's measured components (None without a profile)."""
    summary = (profile or {}).get("summary", {})
    best = summary.get("theoretical_best_s", {})
    if not all(name in best for name in FALLBACK_ARMS):
        return None
    other = max(0.0, float(summary.get("t_other", 0.0)))
    return [float(best[name]) + other for name in FALLBACK_ARMS]


def fallback_choice(options: DeAROptions, profile_of: Callable[[], Optional[dict[str, Any]]]) -> MeasuredChoice:
    """The choice `DeAROptions.fallback="when_faster"` makes; `profile_of` returns the run's profile when it starts."""
    return MeasuredChoice(
        options.confirm_steps,
        options.confirm_rounds,
        options.drift,
        options.drift_steps,
        predict=lambda: predicted_steps(profile_of()),
        max_rounds=options.confirm_max_rounds,
    )


def describe_fallback(choice: MeasuredChoice) -> str:
    """For the log and the closing summary: predicted, measured, chosen."""
    verdict = choice.verdict
    if verdict is None:
        return "DeAR or WFBP: still measuring"
    said = f"DeAR or WFBP: {verdict.describe(FALLBACK_ARMS)}"
    if verdict.keep == WFBP:
        return f"{said} (the same math: DeAR has nothing to hide here)"
    return said
