"""Schedule runtimes, one file per schedule, and the registry of them.

Adding a schedule is one file: a `Schedule` subclass registered with `commsched.register_schedule`
(which also makes its Lightning strategy). Nothing in the strategy, the engine, the profiler, the
bench or the simulator changes: they ask the registry and the schedule (`links_used`,
`step_collectives`, `theoretical_best`, `simulate`, `state_dict`).
"""

from commsched.schedules.base import Handover, Schedule
from commsched.schedules.dear import DeARSchedule
from commsched.schedules.deft import DeFTSchedule
from commsched.schedules.wfbp import WFBPSchedule

SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (WFBPSchedule, DeARSchedule, DeFTSchedule)}
"""Every schedule by name, the built-in ones and those `commsched.register_schedule` added."""

__all__ = ["DeARSchedule", "DeFTSchedule", "Handover", "SCHEDULES", "Schedule", "WFBPSchedule"]
