"""Schedule runtimes: one file per schedule, each a `Schedule` subclass."""

from commsched.schedules.base import Schedule
from commsched.schedules.dear import DeARSchedule
from commsched.schedules.wfbp import WFBPSchedule

__all__ = ["DeARSchedule", "Schedule", "WFBPSchedule"]
