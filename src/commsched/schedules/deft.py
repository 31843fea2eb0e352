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
user's optimizer as `.grad`. An iteration with nothing to step runs the closure (forward,
backward, hooks) but not `optimizer.step`; LR schedulers stepped per step follow the optimizer
steps actually taken.

After solving, the iterations may be handed to an exact schedule on the same buckets
(`commsched.deft.predict.choose_schedule`): `DeARSchedule` when it is predicted clearly faster from
the same measurements (it hides the all-gathers under the next forward, which an undelayed
all-reduce cannot), else `WFBPSchedule` when the plan is DDP's schedule anyway (the same
collectives without generations). A re-plan takes them back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

from torch import nn
from torch.optim import Optimizer

from commsched.buckets import BucketPlan
from commsched.deft.generations import BufferPool, Generation
from commsched.deft.measure import StageMeter, agreed_stage_times, all_reduce_seconds, halves_seconds, load_halves, load_timings
from commsched.deft.predict import Choice, choose_schedule
from commsched.deft.plan import BACKWARD, FORWARD, LINK_NAMES, DeFTPlan, Item, Iteration, Launch, Timings, no_delay_plan, plan_for
from commsched.deft.probes import GradientProbes
from commsched.errors import ScheduleError
from commsched.links import Links
from commsched.options import DeFTOptions
from commsched.schedules.base import Observed, Schedule, params_of
from commsched.schedules.dear import DeARSchedule, DeARSettings
from commsched.schedules.wfbp import WFBPSchedule
from commsched.schedules.step_control import run_with_step_replaced

log = logging.getLogger(__name__)


@dataclass
class DeFTSettings:
    """What the strategy hands DeFT besides buckets and links."""

    options: DeFTOptions = field(default_factory=DeFTOptions)
    preserver: Any = None
    """A `commsched.Preserver` among the Trainer's callbacks, if any."""
    advance_schedulers: Callable[[], None] = lambda: None
    """Steps the per-step LR schedulers once (before a second optimizer step in one iteration)."""


class DeFTSchedule(Schedule):
    name = "deft"
    description = "commsched DeFT: delayed updates solved by knapsacks over a primary and a secondary link"
    links_used = ("primary", "secondary")
    step_collectives = ("all_reduce",)
    grads_complete_after_closure = False  # iterations without a step: an fp16 GradScaler would see no gradients
    skips_steps = True
    mask_link = "control"  # the primary may still carry older generations into the next forward

    def __init__(self, plan: BucketPlan, links: Links, observed: Observed = Observed(), settings: Any = None) -> None:
        super().__init__(plan, links, observed, settings)
        self.settings: DeFTSettings = settings if isinstance(settings, DeFTSettings) else DeFTSettings()
        self.options = self.settings.options
        self._links = [links[name] for name in LINK_NAMES]
        self.deft_plan: DeFTPlan = no_delay_plan(self._whole_buckets())
        self.decided = False
        self.iteration = 0  # into the replay of `deft_plan`
        self.seen = 0  # synchronised iterations before the plan was decided
        self.timings: Optional[Timings] = None
        self.decisions: list[dict[str, Any]] = []
        self._generations: dict[int, Generation] = {}
        self._pool = BufferPool(plan)
        self._now: Optional[Iteration] = None
        self._due: list[int] = []
        self._clip: Optional[tuple[float, str]] = None
        self._meter = StageMeter()
        self._probes = GradientProbes(links.control, self.link.world_size, self.link.rank)
        self._stepper: Optional[tuple[Optimizer, Callable[[], Any]]] = None
        self.steps_this_iteration = 0
        self._replan = False
        self._module: Optional[nn.Module] = None
        self.handed: Optional[Schedule] = None
        """DeAR or WFBP running the iterations on the same buckets instead of the plan (see `choose_schedule`)."""
        self.choice = Choice("plan")

    @classmethod
    def settings_for(cls, options: Any, trainer: Any, advance_schedulers: Callable[[], None]) -> DeFTSettings:
        from commsched.deft.preserver import Preserver

        preserver = next((c for c in trainer.callbacks if isinstance(c, Preserver)), None)
        return DeFTSettings(options.deft, preserver, advance_schedulers)

    # ----------------------------------------------------------------- lifecycle
    def attach(self, module: nn.Module) -> None:
        self._module = module
        super().attach(module)

    def detach(self) -> None:
        super().detach()
        if self.handed is not None:
            self.handed.detach()

    @Schedule.sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self.capture.sync_enabled = value
        if self.handed is not None:
            self.handed.sync_enabled = value

    def _hand_over(self, choice: Choice) -> None:
        """The chosen schedule's hooks replace DeFT's on the same buckets (at an iteration boundary: nothing is delayed)."""
        assert self._module is not None and not self._generations
        self.capture.detach()
        self.choice = choice
        if choice.runs == "dear":
            self.handed = DeARSchedule(self.plan, self.links, self.observed, DeARSettings(tuple(choice.dear_links)))
        else:
            self.handed = WFBPSchedule(self.plan, self.links, self.observed)
        self.handed.attach(self._module)
        self.handed.sync_enabled = self.capture.sync_enabled
        self.steps_this_iteration = 1

    def _take_back(self) -> None:
        """DeFT's hooks again (a re-plan): DeAR's pending update is applied first."""
        assert self.handed is not None
        self.handed.flush()
        self.handed.detach()
        self.handed, self.choice = None, Choice("plan")
        self.capture.attach()

    def _whole_buckets(self) -> list[Item]:
        return [Item(b, 0, bucket.buffer.numel()) for b, bucket in enumerate(self.plan.buckets)]

    @property
    def _measuring(self) -> bool:
        return not self.decided and self.seen >= self.options.warmup_steps

    def request_replan(self) -> None:
        """Measure and solve again (every rank at the same step): delayed gradients are applied first."""
        self._replan = True

    def _restart_measuring(self) -> None:
        self.drain()
        self._replan = False
        self.deft_plan, self.decided, self.iteration = no_delay_plan(self._whole_buckets()), False, 0
        self.seen = self.options.warmup_steps
        self._meter = StageMeter()
        self._probes.projections.clear()

    # ---------------------------------------------------------------- iteration
    def before_forward(self) -> None:
        if self.handed is not None:
            return self.handed.before_forward()
        if self._now is not None or not self.sync_enabled:
            return  # a later micro-batch of the same step, or an accumulation micro-batch
        if self._replan:
            self._restart_measuring()
        if not self.decided and self.seen >= self.options.warmup_steps + self.options.measure_steps:
            self._decide()
            if self.handed is not None:
                return self.handed.before_forward()
        self._now = self.deft_plan.at(self.iteration)
        self.steps_this_iteration = 0
        self._clip = None
        self._launch(FORWARD, lambda launch: True)
        if self._measuring:
            self._meter.forward_started()

    def after_forward(self) -> None:
        if self.handed is not None:
            return self.handed.after_forward()
        if self._now is None or not self.sync_enabled:
            return
        if self._measuring:
            self._meter.forward_done()
        joins = self._now.joins
        self._launch(BACKWARD, lambda launch: launch.generation != joins)

    def _bucket_ready(self, b: int) -> None:
        if self._now is None:  # a step whose forward ran outside training_step (e.g. manual backward)
            self._now = self.deft_plan.at(self.iteration)
        generation = self._generation(self._now.joins)
        generation.merge(b, self.plan.buckets[b].buffer, first=generation.k == 0)
        if self._measuring:
            self._meter.bucket_ready()
        joins = self._now.joins
        items = self.deft_plan.items
        self._launch(BACKWARD, lambda launch: launch.generation == joins and items[launch.item].bucket == b)

    def _backward_end(self) -> None:
        self.capture.read_mask()
        generation = self._generation(self._now.joins)
        generation.k += 1
        for b, flags in enumerate(self.capture.globally_used):
            generation.used[b] = [u or f for u, f in zip(generation.used[b], flags)]
        self._due = list(self._now.steps)
        if self._due:
            self._generations[self._due[0]].hand_to_optimizer(self.plan)
            if self._measuring and self.link.world_size > 1:
                self._probes.record([b.buffer for b in self.plan.buckets], self._generations[self._due[0]].buffers)

    def _generation(self, number: int) -> Generation:
        if number not in self._generations:
            self._generations[number] = Generation(number, self._pool.take(), self.plan)
        return self._generations[number]

    def _launch(self, stage: str, which: Callable[[Launch], bool]) -> None:
        assert self._now is not None
        for launch in self._now.launches:
            if launch.stage == stage and which(launch):
                self._send(self._generations.get(launch.generation) or self._missing(launch), launch.item, launch.link)

    def _missing(self, launch: Launch) -> Generation:
        raise ScheduleError(f"commsched deft: the plan sends generation {launch.generation} before any iteration joined it "
                            f"(iteration {self.iteration}); the plan is inconsistent: {self.deft_plan.describe()}")

    def _send(self, generation: Generation, index: int, link: int) -> None:
        item = self.deft_plan.items[index]
        if index in generation.sent:
            raise ScheduleError(f"commsched deft: item {index} of generation {generation.number} planned twice")
        generation.sent.add(index)
        piece = generation.buffers[item.bucket].narrow(0, item.start, item.numel)
        generation.works.append(self._links[link].all_reduce(piece, f"g{generation.number}.b{item.bucket}.{item.start}"))

    # ------------------------------------------------------------------- update
    def finish_backward(self) -> None:
        if self.handed is not None:
            return self.handed.finish_backward()
        super().finish_backward()

    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        if self.handed is not None:
            result = self.handed.optimizer_step(optimizer, run_step)
            if self._replan:  # measured again from the next step, by DeFT's own hooks
                self._take_back()
            return result
        try:
            return run_with_step_replaced(optimizer, run_step, partial(self._step_or_defer, optimizer))
        finally:
            self._end_iteration()

    def _step_or_defer(self, optimizer: Optimizer, real_step: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        if isinstance(self.handed, DeARSchedule):  # handed over in this very closure's forward: DeAR takes the step
            self.handed.defer_step(optimizer, lambda: real_step(**kwargs))
        elif self.handed is not None:  # WFBP: `.grad` is whole since its backward ended
            real_step(**kwargs)
        else:
            self._step_due(optimizer, lambda: real_step(**kwargs))

    def _step_due(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        self._stepper = (optimizer, real_step)
        for position, number in enumerate(self._due):
            if position > 0:  # a second generation completes in this iteration
                self._generations[number].hand_to_optimizer(self.plan)
                if self._clip is not None:
                    super().clip_gradients(optimizer, *self._clip)
                self.settings.advance_schedulers()
            real_step()
            self._release(number)
            self.steps_this_iteration += 1
        self._due = []
        # Lightning's loop called step(); torch's schedulers must not warn that they stepped first.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _release(self, number: int) -> None:
        generation = self._generations.pop(number)
        self._pool.give_back(generation.buffers)

    def _end_iteration(self) -> None:
        if self._now is None:
            return
        self._now = None
        if self.decided:
            self.iteration += 1
        else:
            self.seen += 1

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: str) -> None:
        if self.handed is not None:
            return self.handed.clip_gradients(optimizer, clip_val, algorithm)
        self._clip = (clip_val, algorithm)
        super().clip_gradients(optimizer, clip_val, algorithm)

    # -------------------------------------------------------------- deciding
    def _decide(self) -> None:
        """Every rank: agree on the measurements; rank 0 solves; everyone adopts the same plan."""
        forward, backward = self._meter.per_bucket_backward(len(self.plan.buckets))
        control = self.links.control
        forward, backward = agreed_stage_times(forward, backward, control)
        shared = False
        if self.options.timings_file is not None:
            timings = load_timings(self.options.timings_file, len(self.plan.buckets))
        else:
            costs, shared = all_reduce_seconds(self.plan, self._links, control, self.options.cost_repeats)
            timings = Timings(forward, backward, costs)
            if shared:
                log.info("commsched deft: the secondary link shares the primary's network (each slows the other "
                         "down): only the primary is used")
        stats = self._probes.walk_statistics(self.settings.preserver)
        halves = self._dear_halves(shared)
        decided = None
        if control.rank == 0:
            decided = self._solve(timings, stats, halves)
        decided = control.broadcast_object(decided, src=0, tag="deft-plan")
        self.deft_plan = DeFTPlan.from_json(decided["plan"])
        self.timings, self.decisions = timings, decided["decisions"]
        self._check_same_plan()
        self.decided, self.iteration = True, 0
        self._probes.projections.clear()
        log.info(f"commsched deft: {self.deft_plan.describe()}; mu = c_secondary/c_primary = {timings.mu:.2f}; "
                 f"T_F {timings.forward * 1e3:.1f} ms, T_B {sum(timings.backward) * 1e3:.1f} ms, "
                 f"all-reduce {sum(timings.costs[0]) * 1e3:.1f} ms primary / {sum(timings.costs[1]) * 1e3:.1f} ms secondary")
        choice = Choice(**decided["choice"])
        if choice.runs != "plan":
            log.info(f"commsched deft: {self._describe_choice(choice)}; deft.fallback=never keeps the plan")
            self._hand_over(choice)
        else:
            self.choice = choice

    def _dear_halves(self, shared: bool) -> Optional[tuple[list[list[float]], list[list[float]]]]:
        """DeAR's reduce-scatter and all-gather times per link and bucket (None: DeAR may not run):
        from the timings file, or timed on every link (the primary alone on a shared wire, where a
        second group gains DeAR nothing either)."""
        if not self._dear_may_run():
            return None
        if self.options.timings_file is not None:
            return load_halves(self.options.timings_file, len(self.plan.buckets))
        measured = [halves_seconds(self.plan, link, self.links.control, self.options.cost_repeats)
                    for link in (self._links[:1] if shared else self._links)]
        return [rs for rs, _ in measured], [ag for _, ag in measured]

    def _dear_may_run(self) -> bool:
        """DeAR is worth predicting: a fallback allowed, not observed every step, more than one rank."""
        return (self.options.fallback != "never" and self.link.world_size > 1
                and not self.observed.gradients and not self.observed.weights_every_step)

    @staticmethod
    def _describe_choice(choice: Choice) -> str:
        predicted = (f"predicted {choice.predicted['dear_ms']:.0f} ms/step vs {choice.predicted['plan_ms']:.0f} ms with "
                     "the plan" if choice.predicted else "")
        if choice.runs == "dear":
            return f"run by DeAR over {'+'.join(sorted(set(choice.dear_links)))} ({predicted})"
        if choice.runs == "wfbp":
            return "run by WFBP (the plan is DDP's schedule" + (f"; DeAR {predicted}" if predicted else "") + ")"
        return "run by the plan" + (f" (DeAR {predicted})" if predicted else "")

    def _solve(self, timings: Timings, stats: dict[str, float],
               halves: Optional[tuple[list[list[float]], list[list[float]]]]) -> dict[str, Any]:
        numels = [b.buffer.numel() for b in self.plan.buckets]

        def solve(capacity: Optional[float]) -> DeFTPlan:
            return plan_for(numels, timings, math.inf if capacity is None else capacity)

        if self.settings.preserver is not None:
            plan, decisions = self.settings.preserver.choose(solve, self.options.capacity, stats)
        else:
            plan, decisions = solve(self.options.capacity), []
        choice = choose_schedule(plan, timings, numels, self.options.fallback, halves)
        return {"plan": plan.to_json(), "decisions": decisions, "choice": vars(choice)}

    def report(self) -> dict[str, Any]:
        """What was decided, for metrics files and benchmark tables."""
        described = self.deft_plan.describe() + (f"; {self._describe_choice(self.choice)}" if self.decided else "")
        return {"plan": described, "n": self.deft_plan.n, "k": list(self.deft_plan.k),
                "staleness": self.deft_plan.staleness, "runs": self.choice.runs, "dear_links": list(self.choice.dear_links),
                "predicted": self.choice.predicted, "mu": self.timings.mu if self.timings is not None else None,
                "preserver": self.decisions}

    def _check_same_plan(self) -> None:
        digest = int(self.deft_plan.digest(), 16) % (2**62)
        digests = self.links.control.all_gather_int(digest, "deft-plan-hash")
        if len(set(digests)) != 1:
            raise ScheduleError(f"commsched deft: ranks replay different plans (hashes {digests})")

    # ---------------------------------------------------------- flush points
    def flush(self) -> None:
        """Checkpoints, validation, callbacks: wait for what is in flight; delayed gradients stay delayed."""
        if self.handed is not None:
            self.handed.flush()
        for generation in self._generations.values():
            generation.drain()

    def drain(self) -> None:
        """End of training, or buckets about to change: send what is left (primary link, generation
        order, item order: the same on every rank) and step with every generation in order."""
        if self.handed is not None:
            self.handed.drain()
        if self._stepper is None or not self._generations:
            self.flush()
            return
        optimizer, real_step = self._stepper
        for number in sorted(self._generations):
            generation = self._generations[number]
            for index in range(len(self.deft_plan.items)):
                if index not in generation.sent:
                    self._send(generation, index, 0)
            generation.hand_to_optimizer(self.plan)
            real_step()
            self._release(number)
        for p in params_of(optimizer):
            p.grad = None
        log.info("commsched deft: delayed gradients applied at the end of training")

    # ---------------------------------------------------- communication state
    def state_dict(self) -> dict[str, Any]:
        if self._replan:  # asked to solve again: the buckets being rebuilt start measuring
            if self.handed is not None:
                self._take_back()
            self._restart_measuring()
        return {"shared": {"deft_plan": self.deft_plan.to_json(), "decided": self.decided, "iteration": self.iteration,
                           "seen": self.seen, "decisions": self.decisions, "choice": vars(self.choice),
                           "bucket_numels": [b.buffer.numel() for b in self.plan.buckets]},
                "per_rank": {"generations": [g.state(self.plan) for g in self._generations.values()],
                             "meter": self._meter.state(), "projections": [list(p) for p in self._probes.projections]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "deft_plan" not in state:
            return
        if state.get("bucket_numels") != [b.buffer.numel() for b in self.plan.buckets]:
            log.info("commsched deft: the buckets changed; measuring and solving again for the new ones")
            return  # drained before any rebuild: nothing delayed is lost
        self.deft_plan, self.decided = DeFTPlan.from_json(state["deft_plan"]), state["decided"]
        self.iteration, self.seen = state["iteration"], state["seen"]
        self.decisions = list(state.get("decisions", []))
        self.choice = Choice(**state.get("choice", {"runs": "plan"}))
        if self.choice.runs != "plan" and self.handed is None:
            self._hand_over(self.choice)
        for saved in state.get("generations", []):
            self._generations[saved["number"]] = Generation.restore(saved, self._pool.take(), self.plan)
        self._meter.load(state["meter"])
        self._probes.projections = [list(p) for p in state.get("projections", [])]

    @staticmethod
    def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """Communication entirely under compute ([DeFT]'s aim): forward plus backward."""
        return t_ff + t_bp
