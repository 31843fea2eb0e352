"""DeFT: delayed updates whose communication a knapsack fits under compute, over two links ([DeFT]).

Lifecycle: `warmup_steps + measure_steps` synchronous steps (every bucket all-reduced in its own
backward on the primary link: DDP's updates) while stage times and gradient statistics are
measured; then each bucket's all-reduce is timed on both links, rank 0 solves the periodic plan
(`commsched.deft.plan`; the Preserver may enlarge the capacity), broadcasts it, and every rank
checks its hash and replays it from the next iteration on.

Per iteration the plan says which generation this iteration's gradients join (they are summed
into that generation's own buffers as each bucket fills), which items of which generation go on
which link in the forward stage (at the start of forward) and in the backward stage (old ones at
the start of backward, this iteration's as their bucket fills), and which generations step at the
end of backward: their items are waited for, averaged over their k iterations and handed to the
user's optimizer as `.grad`. An iteration with nothing to step runs the closure (forward, backward,
hooks) but not `optimizer.step`; LR schedulers stepped per step follow the optimizer steps taken.

After solving, the iterations may go to an exact schedule (`Handover`, chosen by
`commsched.deft.iteration_model.choose_schedule` and confirmed on real steps by `commsched.deft.confirm`):
WFBP on the primary, always a candidate, or DeAR (it hides the all-gathers under the next forward),
whichever is predicted fastest, the plan only when clearly faster than both. A re-plan takes them back.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer
from typing_extensions import override

from commsched.comm.buckets import BucketPlan
from commsched.comm.link_groups import Links
from commsched.deft.compensator import Compensator
from commsched.deft.confirm import Confirmation
from commsched.deft.decision import decide_plan, report
from commsched.deft.generations import InFlight
from commsched.deft.iteration_model import ScheduleChoice
from commsched.deft.measure import StageMeter
from commsched.deft.plan import BACKWARD, FORWARD, LINK_NAMES, DeFTPlan, Item, Iteration, Launch, Timings, no_delay_plan
from commsched.deft.probes import GradientProbes
from commsched.deft.saved_state import load_saved_state, saved_state
from commsched.deft.settings import (
    DeFTSettings,
    refuse_uncompensable_optimizers,
    settings_for,
    stale_barred,
    steps_trained,
    users_optimizer,
)
from commsched.deft.stale_watch import StaleWatch
from commsched.options import DeFTOptions, StrategyOptions
from commsched.say import say
from commsched.schedules.base import Handover, Schedule, params_of
from commsched.schedules.dear import DeARSettings
from commsched.schedules.optimizer_step import hooked_step, run_with_step_replaced
from commsched.sim.cost_models import CostModel
from commsched.sim.timelines import Buckets, Result
from commsched.sim.workload import Workload


class DeFTSchedule(Schedule[DeFTSettings]):
    name = "deft"
    options_class = DeFTOptions  # the Preserver's are apart: a callback of their own can replace it
    planner = "dear-model"  # its exact candidates (DeAR most often) run on the planned buckets
    hands_over_to = ("dear", "wfbp")
    description = "commsched DeFT: delayed updates solved by knapsacks over a primary and a secondary link"
    links_used = ("primary", "secondary")
    steps_whole = False  # generations step while other generations are in flight on the links
    step_collectives = ("all_reduce",)
    skips_steps = True
    mask_link = "control"  # the primary may still carry older generations into the next forward

    def __init__(self, plan: BucketPlan, links: Links, settings: Any = None) -> None:
        super().__init__(plan, links, settings)
        self.settings: DeFTSettings = settings if isinstance(settings, DeFTSettings) else DeFTSettings()
        self.options = self.settings.options
        self._links = [links[name] for name in LINK_NAMES]
        self.deft_plan: DeFTPlan = no_delay_plan(self.whole_buckets())
        self.decided = False
        self.iteration = 0  # into the replay of `deft_plan`
        self.seen = 0  # synchronised iterations before the plan was decided
        self.timings: Optional[Timings] = None
        self.decisions: list[dict[str, Any]] = []
        self.choice = ScheduleChoice("plan")
        """What runs the iterations once decided: the plan, or an exact schedule it hands them to."""
        self.in_flight = InFlight(plan)
        self._now: Optional[Iteration] = None
        self._due: list[int] = []
        self._clip: Optional[tuple[float, str]] = None
        self.meter = StageMeter(plan.buckets[0].buffer.device)
        self.probes = GradientProbes(links.control, self.link.world_size, self.link.rank)
        self._stepper: Optional[tuple[Optimizer, Callable[[], Any]]] = None
        self.steps_this_iteration = 0
        self.replan_requested = False
        self.replan_at: Optional[int] = None  # the step from which a stale plan waiting may run: solve again then
        self._curvature_step = False
        self.confirmation: Optional[Confirmation] = None
        """While the predicted choice and its runner-up are timed on real steps."""
        self.updates = 0
        """Optimizer steps taken: a generation stepped now is `updates - joined_at` steps late."""
        self.compensator = Compensator(
            self.options.compensation,
            [p for b in plan.buckets for p in b.params],
            [n for b in plan.buckets for n in b.names],
        )
        guard = self.settings.preserver
        self.watch = StaleWatch(
            guard.watch_steps if guard is not None and guard.max_staleness > 0 else 0, bool(guard and guard.rollback)
        )

    @classmethod
    @override
    def settings_for(
        cls, options: StrategyOptions, trainer: Any, advance_schedulers: Callable[[], None]
    ) -> DeFTSettings:
        return settings_for(options, trainer, advance_schedulers)

    @classmethod
    @override
    def refuse_optimizers(cls, options: StrategyOptions, optimizers: list[Optimizer]) -> None:
        refuse_uncompensable_optimizers(options.deft.compensation, optimizers)

    def whole_buckets(self) -> list[Item]:
        return [Item(b, 0, bucket.buffer.numel()) for b, bucket in enumerate(self.plan.buckets)]

    @property
    def _measuring(self) -> bool:
        return not self.decided and self.seen >= self.options.warmup_steps

    # ---------------------------------------------------------------- deciding
    @override
    def at_boundary(self) -> Optional[Handover]:
        """Measure, solve and choose once the measured steps are over; the iterations go to DeAR or
        WFBP when that was chosen (and come back on a re-plan). A stale plan is watched from its first
        iteration, and stopped here when its loss did not fall (`deft.watch`)."""
        if self.replan_at is not None and steps_trained(self.module) >= self.replan_at:
            self.replan_requested, self.replan_at = True, None  # stale plans may run from now on: solve again
        if self.watch.iteration_ended(self.links.control):  # a re-plan rebuilt the schedule first: nothing to judge
            self._stop_the_plan()
        if self.replan_requested or (self.settling and not self.decided and self.seen > self.options.warmup_steps):
            self._restart_measuring()  # (while the buckets are being decided, measure nothing yet)
        if (
            not self.decided
            and not self.settling
            and self.seen >= self.options.warmup_steps + self.options.measure_steps
        ):
            self._decide()
        if self.confirmation is not None:
            confirmed = self.confirmation.at_boundary()
            if confirmed is not None:
                self.choice, self.confirmation = confirmed, None
        if not self.decided:
            return None
        running = self.confirmation.running if self.confirmation is not None else self.choice
        if running.runs != "plan":
            if self.in_flight:
                self.drain()  # a delayed plan timed before an exact schedule: its generations step now
            self.compensator.forget()
            self.iteration = 0  # when the plan takes the iterations back, its replay starts with nothing in flight
        if running.runs == "dear":
            return Handover("dear", DeARSettings(tuple(running.dear_links)))
        if running.runs == "wfbp":
            return Handover("wfbp")
        self._start_watching()
        return None

    @property
    def _stale_plan_runs(self) -> bool:
        return (
            self.decided and self.confirmation is None and self.choice.runs == "plan" and self.deft_plan.staleness > 0
        )

    @override
    def on_loss(self, loss: torch.Tensor) -> None:
        self.watch.listen(loss, self.decided and self.confirmation is None, self._stale_plan_runs)

    def _start_watching(self) -> None:
        """A stale plan starting is watched from nothing in flight (what it ran while confirmed is applied first)."""
        if not self.watch.starts_now(self._stale_plan_runs):
            return
        if self.in_flight:
            self._drain_because("before the watch's snapshot")
            self.compensator.forget()
            self.iteration = 0
        self.watch.start(self.module, users_optimizer(self._stepper, self.module), self.updates)

    def _stop_the_plan(self) -> None:
        """Its loss did not fall: back to its start (or on from here), stale plans refused, measure and solve again."""
        if self.watch.rollback:
            self.in_flight.drop()
            taken = self.watch.roll_back(self.module, users_optimizer(self._stepper, self.module))
            self.updates = taken if taken is not None else self.updates
            self.compensator.forget()
            back = "weights, buffers and optimizer state back to where it started"
        else:
            self._drain_because("as the watch stopped the plan")
            back = "its delayed gradients applied"
        say(
            f"commsched Preserver: the stale plan is stopped ({self.watch.verdict}); {back}; stale plans are refused "
            f"for the rest of this run, and DeFT measures and solves again"
        )
        self._restart_measuring()

    @override
    def request_replan(self) -> None:
        """Measure and solve again (every rank at the same step): delayed gradients are applied first."""
        self.replan_requested = True

    def _restart_measuring(self) -> None:
        self._drain_because("before measuring again")
        self.replan_requested = False
        self.deft_plan, self.decided, self.iteration = no_delay_plan(self.whole_buckets()), False, 0
        self.choice = ScheduleChoice("plan")
        self.confirmation, self.replan_at = None, None
        self.watch.restart()
        self.seen = self.options.warmup_steps
        self.meter = StageMeter(self.plan.buckets[0].buffer.device)
        self.probes.clear()

    def _decide(self) -> None:
        optimizer = self._stepper[0] if self._stepper is not None else None
        barred, wait_until = stale_barred(self.settings.preserver, self.watch.stale_refused, self.module)
        decision = decide_plan(
            self.plan,
            self._links,
            self.links.control,
            self.options,
            self.settings.preserver,
            self.meter,
            self.probes,
            self.compensator.name,
            self.compensator.measured_staleness(optimizer),
            barred,
            wait_until,
        )
        self.deft_plan, self.timings, self.choice, self.decisions = (
            decision.plan,
            decision.timings,
            decision.choice,
            decision.preserver,
        )
        self.decided, self.iteration = True, 0
        self.watch.verdict = None  # a new plan: watched if it is stale and runs
        self.replan_at = max((d["wait_until"] for d in self.decisions if d.get("waiting")), default=None)  # rank 0's
        self.confirm_later()
        self.probes.clear()

    def confirm_later(self) -> None:
        """The predicted choice and its runner-up run real steps before one is kept (`deft.confirm`)."""
        if self.options.confirm_steps and self.choice.alternative is not None and self.links.control.world_size > 1:
            self.confirmation = Confirmation(
                self.choice, self.options.confirm_steps, self.links.control, self.plan.buckets[0].buffer.device
            )

    @classmethod
    @override
    def keeps_its_buckets(cls, options: StrategyOptions) -> bool:
        return bool(options.deft.timings_file)  # the file's times are per bucket of the fixed layout

    @property
    @override
    def settled(self) -> bool:
        return self.decided and self.confirmation is None

    @override
    def summary(self) -> list[str]:
        ran = f"; its iterations ran on {self.choice.runs}" if self.decided else " (still measuring)"
        late = self.deft_plan.staleness and self.choice.runs == "plan"
        compensated = (
            f"; late generations compensated: {self.compensator.name}"
            if late and self.compensator.name != "none"
            else ""
        )
        return [f"plan {self.deft_plan.describe()}{ran}{compensated}{self.watch.describe()}", *super().summary()]

    def report(self) -> dict[str, Any]:
        """What was decided, for metrics files and benchmark tables."""
        return report(
            self.deft_plan,
            self.choice,
            self.decided,
            self.options,
            self.links.control.world_size,
            self.timings,
            self.decisions,
            self.compensator.name,
            self.watch.verdicts,
            self.watch.stale_refused,
        )

    # ---------------------------------------------------------------- iteration
    @override
    def before_forward(self) -> None:
        if (
            self.compensator.prediction is not None
            and self.decided
            and self.deft_plan.delayed
            and self.choice.runs == "plan"
        ):
            # every micro-batch of the iteration (accumulated ones too) on the same predicted weights
            self.compensator.predict(self.deft_plan.steps_until_applied(self.iteration))
        if self._now is not None or not self.sync_enabled:
            return  # a later micro-batch of the same step, or an accumulation micro-batch
        self._now = self.deft_plan.at(self.iteration)
        self.steps_this_iteration = 0
        self._clip = None
        self._launch(FORWARD, lambda launch: True)
        if self._measuring:
            self.meter.forward_started()
            self._ask_for_curvature()

    @override
    def after_forward(self) -> None:
        if self._now is None or not self.sync_enabled:
            return
        if self._measuring:
            self.meter.forward_done()
        joins = self._now.joins
        self._launch(BACKWARD, lambda launch: launch.generation != joins)

    @override
    def on_bucket_ready(self, b: int) -> None:
        if self._now is None:  # a step whose forward ran outside training_step (e.g. manual backward)
            self._now = self.deft_plan.at(self.iteration)
        generation = self.in_flight.joined(self._now.joins)
        generation.merge(b, self.plan.buckets[b].buffer, first=generation.k == 0)
        if self._measuring:
            self.meter.bucket_ready()
        joins = self._now.joins
        items = self.deft_plan.items
        self._launch(BACKWARD, lambda launch: launch.generation == joins and items[launch.item].bucket == b)

    @override
    def on_backward_end(self) -> None:
        self.compensator.restore()
        self.capture.read_mask()
        generation = self.in_flight.joined(self._now.joins)
        generation.k += 1
        generation.joined_at = self.updates
        for b, flags in enumerate(self.capture.globally_used):
            generation.used[b] = [u or f for u, f in zip(generation.used[b], flags)]
        self._due = list(self._now.steps)
        if self._due:
            self.in_flight[self._due[0]].hand_to_optimizer(self.plan, len(self.deft_plan.items))
            if self._measuring and self.link.world_size > 1:
                self.probes.record([b.buffer for b in self.plan.buckets], self.in_flight[self._due[0]].buffers)

    def _launch(self, stage: str, which: Callable[[Launch], bool]) -> None:
        assert self._now is not None
        self.in_flight.launch(
            [launch for launch in self._now.launches if launch.stage == stage and which(launch)],
            self.deft_plan,
            self._links,
            self.iteration,
        )

    # ------------------------------------------------------------------- update
    @override
    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        try:
            step_due = lambda real_step, kwargs: self._step_due(optimizer, partial(real_step, **kwargs))  # noqa: E731
            output = run_with_step_replaced(optimizer, run_step, step_due)
            self._drop_skipped()
            return output
        finally:
            self._end_iteration()

    def _drop_skipped(self) -> None:
        """fp16's scaler skipped the step (an inf on some rank): the due generations are dropped, as DDP
        drops that step's gradients, and the step counts for the LR schedulers, as Lightning's does."""
        for number in self._due:
            self.in_flight.release(number)
            self.steps_this_iteration += 1
        self._due = []

    @override
    def unscale_gradients(self, optimizer: Optimizer, inv_scale: torch.Tensor) -> Optional[torch.Tensor]:
        """Under fp16's scaler DeFT runs plans without delay (`settings_for`): each iteration steps its own
        generation, whole in `.grad`, and torch's scaler unscales it; an iteration with nothing to step
        (a drained plan's) has nothing to find."""
        if self._due:
            return None
        return torch.zeros((), dtype=torch.float32)

    def _step_due(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        self._stepper = (optimizer, real_step)
        for position, number in enumerate(self._due):
            if position > 0:  # a second generation completes in this iteration
                self.in_flight[number].hand_to_optimizer(self.plan, len(self.deft_plan.items))
                if self._clip is not None:
                    super().clip_gradients(optimizer, *self._clip)
                self.settings.advance_schedulers()
            if self._measuring and position == 0:
                self._apply(optimizer, partial(self.probes.step, optimizer, real_step), number)
            else:
                self._apply(optimizer, real_step, number)
            self.in_flight.release(number)
            self.steps_this_iteration += 1
        self._due = []
        # Lightning's loop called step(); torch's schedulers must not warn that they stepped first.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _apply(self, optimizer: Optimizer, real_step: Callable[[], Any], number: int) -> None:
        """The user's step on generation `number`'s gradients, compensated for how late they are (a
        measured step is never late)."""
        late = self.updates - self.in_flight[number].joined_at
        self.compensator.step(optimizer, real_step, late, may_predict=not self.decided or self.deft_plan.delayed)
        self.updates += 1

    def _ask_for_curvature(self) -> None:
        guard = self.settings.preserver
        if guard is not None and guard.ask_for_curvature(
            self.seen - self.options.warmup_steps, self.options.measure_steps
        ):
            self._curvature_step = True

    def _end_iteration(self) -> None:
        self.compensator.restore()  # a step whose backward never ran
        if self._now is None:
            return
        if self._curvature_step:
            self.meter.forget_last()
            self._curvature_step = False
        self._now = None
        if self.decided:
            self.iteration += 1
        else:
            self.seen += 1

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: str) -> Optional[torch.Tensor]:
        self._clip = (clip_val, algorithm)
        return super().clip_gradients(optimizer, clip_val, algorithm)

    # ---------------------------------------------------------- flush points
    @override
    def flush(self) -> None:
        """Checkpoints, validation, callbacks: wait for what is in flight; delayed gradients stay delayed."""
        self.in_flight.wait()

    @override
    def drain(self) -> None:
        """End of training, or buckets about to change: send what is left (primary link, generation
        order, item order: the same on every rank) and step with every generation in order."""
        self._drain_because("at the end of training")

    def _drain_because(self, why: str) -> None:
        optimizer = users_optimizer(self._stepper, self.module)
        if optimizer is None or not self.in_flight:
            self.flush()
            return
        for number in self.in_flight.in_order():
            self.in_flight.send_the_rest(number, self.deft_plan.items, self._links[0])
            self.in_flight[number].hand_to_optimizer(self.plan, len(self.deft_plan.items))
            # a step of its own, outside Lightning's: the user's step hooks run around it
            hooked_step(
                optimizer,
                optimizer.step,
                {},
                lambda quiet_step, kwargs: self._apply(optimizer, partial(quiet_step, **kwargs), number),
            )
            self.in_flight.release(number)
        for p in params_of(optimizer):
            p.grad = None
        say(f"commsched deft: delayed gradients applied {why}")

    # ---------------------------------------------------- communication state
    @override
    def state_dict(self) -> dict[str, Any]:
        return saved_state(self)

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_saved_state(self, state)

    @staticmethod
    @override
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """Communication entirely under compute ([DeFT]'s aim): forward plus backward."""
        return t_ff + t_bp

    @classmethod
    @override
    def simulate(cls, workload: Workload, network: CostModel, workers: int, buckets: Buckets) -> Result:
        from commsched.sim.deft_timeline import deft

        return deft(workload, network, workers, buckets=buckets)
