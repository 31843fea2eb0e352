"""What a commsched strategy reports about its run: read-only views of its engine, for tests,
benchmarks, callbacks and the metrics files (kept apart from the strategy's lifecycle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from commsched.comm.buckets import BucketPlan
from commsched.comm.link_groups import Links
from commsched.comm.links import CollectiveRecord, Link
from commsched.planning.plan_file import SavedPlan
from commsched.schedules import Schedule

if TYPE_CHECKING:
    from commsched.runtime.engine import Engine


class RunReports:
    """Mixed into `CommSchedStrategy`; everything here reads `self._engine`."""

    _engine: "Engine"

    @property
    def schedule(self) -> Optional[Schedule]:
        """The running schedule (the configured one, or the one it handed its iterations to)."""
        return self._engine.schedule

    @property
    def last_schedule(self) -> Optional[Schedule]:
        """The configured schedule (which may hand its iterations to another), or the last fit's once it
        ended (what it measured and decided)."""
        return self._engine.owner or self._engine.finished

    @property
    def settled(self) -> bool:
        """Every automatic choice of this fit is made (the buckets, the schedule's own searches): the
        steps from here on are the steady state a benchmark should time. False before setup."""
        deciding = self._engine.deciding_schedule
        return deciding is not None and not self._engine.policy.deciding and deciding.settled

    @property
    def bucket_plan(self) -> Optional[BucketPlan]:
        return self.schedule.plan if self.schedule is not None else None

    @property
    def links(self) -> Optional[Links]:
        """The run's links by name (``links["primary"]``, ``links.control``), once set up."""
        return self._engine.links

    @property
    def control_link(self) -> Link:
        """The default group's link: setup checks, buffer broadcasts, plan decisions."""
        assert self._engine.links is not None, "links exist once the strategy is set up"
        return self._engine.links.control

    @property
    def exposed_comm_seconds(self) -> float:
        """Time this rank's training loop waited on communication (not hidden behind compute), all links."""
        return self.links.exposed_seconds if self.links is not None else 0.0

    @property
    def wire_bytes(self) -> dict[str, float]:
        """Bytes this rank has sent per link so far (ring counts), {} before setup."""
        return self.links.wire_bytes if self.links is not None else {}

    @property
    def fusion_plan(self) -> Optional[SavedPlan]:
        """The plan a planner, the tuner, a plan file or a checkpoint decided (None while still deciding)."""
        return self._engine.policy.decided

    @property
    def deft_plan(self) -> Any:
        """DeFT's plan (`commsched.deft.plan.DeFTPlan`) of the running or last fit, None for other schedules."""
        return getattr(self.last_schedule, "deft_plan", None)

    @property
    def tuning_trials(self) -> list[dict[str, float]]:
        return list(self._engine.policy.trials)

    @property
    def profile(self) -> Optional[dict[str, Any]]:
        """What profiling measured (the content of profile.json), once it finished."""
        return self._engine.profiler.result if self._engine.profiler is not None else None

    @property
    def collective_trace(self) -> list[CollectiveRecord]:
        """Collectives issued by this rank during the last fit (needs ``trace_collectives=True``)."""
        return list(self._engine.trace or [])
