"""Schedule runtimes, one file per schedule, and the registry of them.

Adding a schedule: a `Schedule` subclass in its own file here, an entry in `SCHEDULES`, and its
named strategy class in `commsched.registry`. Nothing in the strategy or the profiler changes:
they ask the schedule (`links_used`, `step_collectives`, `theoretical_best`, `state_dict`).
"""

from commsched.schedules.base import Observed, Schedule
from commsched.schedules.dear import DeARSchedule
from commsched.schedules.deft import DeFTSchedule
from commsched.schedules.wfbp import WFBPSchedule

SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (WFBPSchedule, DeARSchedule, DeFTSchedule)}

__all__ = ["DeARSchedule", "DeFTSchedule", "Observed", "SCHEDULES", "Schedule", "WFBPSchedule"]
