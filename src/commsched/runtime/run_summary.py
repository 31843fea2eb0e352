"""The few lines a fit ends with: what commsched did, what it cost, where its files are, how to go on.

Without them a run on `dear` looks exactly like one on `ddp`: nothing says which buckets were
used, whether communication hid behind compute, what a search chose or where its files went.
Rank 0 says them once, at the end of a fit that completed (an interrupted one says where it
stopped instead). Each part reads what the strategy already measured; nothing here times anything.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from commsched.errors import current_syntax
from commsched.say import size_text

RECENT_STEPS = 50
"""The closing summary's per-step figures are medians over the fit's last steps (its steady state:
after warm-up, profiling and whatever was decided on timed steps)."""


class StepClock:
    """At every optimizer step's end: the time, and the strategy's cumulative time waited on
    communication and bytes sent (the last `RECENT_STEPS` kept)."""

    def __init__(self) -> None:
        self.steps = 0
        self._ends: deque[tuple[float, float, float]] = deque(maxlen=RECENT_STEPS + 1)

    def stepped(self, waited_s: float = 0.0, sent_bytes: float = 0.0) -> None:
        self._ends.append((time.perf_counter(), waited_s, sent_bytes))
        self.steps += 1

    def recent(self) -> Optional[tuple[float, float, float]]:
        """Median step seconds, seconds waited and bytes sent a step, over the last steps."""
        if len(self._ends) < 2:
            return None
        deltas = [tuple(b - a for a, b in zip(x, y)) for x, y in zip(self._ends, list(self._ends)[1:])]
        return tuple(statistics.median(d[i] for d in deltas) for i in range(3))  # type: ignore[return-value]


def describe_buckets(strategy: Any) -> str:
    """``4 buckets of 12.3 MB of gradients (fixed, 25 MB cap)`` or ``... (planned by dear-model)``."""
    plan = strategy.bucket_plan
    if plan is None:
        return "no buckets"
    total = sum(b.numel * b.buffer.element_size() for b in plan.buckets)
    fusion = strategy.options.fusion
    decided = strategy.fusion_plan
    auto = decided.details.get("auto") if decided is not None else None
    if auto is not None:
        fixed_ms, planned_ms = auto["step_ms"]
        how = (
            f"{auto['planner']}'s plan, {fixed_ms / planned_ms:.2f}x fixed buckets"
            if auto["kept"] == "planned"
            else f"fixed {fusion.bucket_cap_mb:.3g} MB buckets: {auto['planner']}'s plan was not faster"
        )
        how += f"; decided in {auto['steps_deciding']} steps"
    elif decided is not None:
        how = f"plan file {fusion.plan_file}" if fusion.plan_file else f"chosen by {decided.policy}"
    elif fusion.policy == "fixed":
        how = f"fixed, {fusion.bucket_cap_mb:.3g} MB cap"
    else:
        how = f"{fusion.policy}, still deciding"
    return f"{len(plan.buckets)} bucket(s) for {size_text(total)} of gradients ({how})"


def describe_time(clock: StepClock) -> Optional[str]:
    recent = clock.recent()
    if recent is None:
        return None
    step, waited, sent = recent
    last = min(clock.steps - 1, RECENT_STEPS)
    return (
        f"{clock.steps} steps; over the last {last}, a median step of {step * 1e3:.1f} ms, of which the training loop "
        f"waited {waited * 1e3:.1f} ms on communication ({waited / step:.0%}); this rank sent {size_text(sent)} a step"
    )


def describe_files(folder: Optional[Path], written: list[Path]) -> Optional[str]:
    if not written:
        return None
    names = sorted({_relative(path, folder) for path in written})
    return f"files in {folder}: {', '.join(names)}" if folder is not None else f"files: {', '.join(names)}"


def _relative(path: Path, folder: Optional[Path]) -> str:
    try:
        return str(path.relative_to(folder)) if folder is not None else str(path)
    except ValueError:
        return str(path)


def resume_hint(trainer: Any) -> Optional[str]:
    """How to continue from the last checkpoint this fit wrote, in the user's syntax (a `StopAndSave`
    among the callbacks knows it best: it saved the final step)."""
    from commsched.runtime.interrupt import StopAndSave

    python = current_syntax() != "hydra"
    for stop in (c for c in trainer.callbacks if isinstance(c, StopAndSave)):
        hint = stop.resume_hint(python=python)
        if hint is not None:
            return f"last checkpoint {stop.last_saved}; continue with: {hint}"
    callback = trainer.checkpoint_callback
    last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    if not last:
        return None
    if not python:
        return (
            f"last checkpoint {last}; continue with: commsched-train resume={Path(last).parent.parent} "
            "(and the same options)"
        )
    return f"last checkpoint {last}; continue with: trainer.fit(model, ckpt_path={last!r})"


def closing_lines(
    strategy: Any, trainer: Any, clock: StepClock, schedule_lines: list[str], written: list[Path]
) -> list[str]:
    parts = [
        describe_buckets(strategy),
        describe_time(clock),
        *schedule_lines,
        describe_files(strategy.run_dir, written),
        resume_hint(trainer),
    ]
    name = strategy.schedule_class.name
    return [f"commsched {name}: " + part for part in parts if part]
