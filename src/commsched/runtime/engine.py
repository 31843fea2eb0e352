"""The communication machinery of one fit: links, the plan policy, the schedule and its state.

The strategy calls the engine at Lightning's fixed points; the engine builds the links a schedule
asks for, builds buckets with the policy's planner (the same on every rank, checked by hash),
rebuilds them at iteration boundaries when the plan or the set of trainable parameters changes,
moves the schedule's communication state across rebuilds by parameter name, starts the profiler
when asked for or when a planner needs one, and carries out hand-overs: a schedule may give its
iterations to another registered schedule on the same buckets (`Handover`, e.g. DeFT to DeAR)
and take them back at a later boundary. The schedule the strategy was configured with (the
*owner*) keeps the communication state; the one *running* receives the loop's calls.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
from torch import nn

from commsched import state
from commsched.comm.buckets import BucketPlan, build_plan, verify_same_on_all_ranks
from commsched.comm.device_time import compute_done
from commsched.comm.link_groups import Links, LinkSpec, local_rank_groups, node_groups
from commsched.comm.links import WIRE_DTYPES, CollectiveRecord
from commsched.errors import CommSchedConfigError
from commsched.options import StrategyOptions
from commsched.options.links import SECONDARY_IFNAME_ENV
from commsched.planning.plan_file import SavedPlan
from commsched.planning.policy import PlanPolicy
from commsched.profile.run_profiler import ASKED_FOR_WARMUP, RunProfiler
from commsched.say import say
from commsched.schedules import SCHEDULES, Handover, Schedule
from commsched.schedules.base import runs_compiled

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, schedule_class: type[Schedule], options: StrategyOptions, trace_collectives: bool) -> None:
        self.schedule_class = schedule_class
        fusion = options.fusion
        if fusion.policy == "auto" and schedule_class.keeps_its_buckets(options):
            fusion = dataclasses.replace(fusion, policy="fixed")
        self._fusion = fusion
        self._tuning = options.tuning
        self._compression = options.compression
        self._comm_hook = options.comm_hook
        self.policy = self._new_policy()
        self.trace: Optional[list[CollectiveRecord]] = [] if trace_collectives else None
        self.owner: Optional[Schedule] = None
        """The configured schedule: it decides hand-overs and keeps the communication state."""
        self.schedule: Optional[Schedule] = None
        """The running schedule: the owner, or the one it handed its iterations to."""
        self.finished: Optional[Schedule] = None  # the last fit's owner, kept for its reports
        self.links: Optional[Links] = None
        self.profiler: Optional[RunProfiler] = None
        self.settings: Any = None  # schedule-specific, from `Schedule.settings_for`
        self.loss_scaler: Any = None  # fp16's GradScaler, handed to every schedule made
        self._profile = options.profile
        self._link_options = options.links
        self.wire_dtype = WIRE_DTYPES[options.comm_dtype]
        self._module: Optional[nn.Module] = None
        self._trainable: tuple[int, ...] = ()
        self._hand_over_plan: Optional[tuple[SavedPlan, BucketPlan]] = None  # (layout, its buckets) for `_plan_for`
        self._iteration_starts = True
        self._local = False  # inside `no_sync`
        self._for_good: Optional[tuple[Handover, str]] = None  # (the schedule that runs every iteration, why)
        self._optimizer_of: dict[int, int] = {}  # parameter id -> the optimizer stepping it (`keep_apart`)
        self._state_later: Optional[state.Restored] = None  # `start(state_later=True)`: loaded by `load_state_later`
        self.compiled_outside = False
        """The module runs under torch.compile applied around a wrapper of it (Fabric's), which the module
        itself does not show (`runs_compiled`)."""
        self._borrowed_links = False  # `start(links=...)`: another engine made them and ends them

    def _new_policy(self) -> PlanPolicy:
        return PlanPolicy(
            self._fusion,
            self._tuning,
            planner=self.schedule_class.planner,
            hand_over_planners=[SCHEDULES[name].planner for name in self.schedule_class.hands_over_to],
        )

    def start(
        self,
        module: nn.Module,
        world_size: int,
        timeout: Optional[timedelta],
        default_backend: Optional[str],
        restored: Optional[state.Restored],
        device: torch.device,
        per_node: int,
        state_later: bool = False,
        links: Optional[Links] = None,
    ) -> None:
        """Links, then buckets and hooks, then the saved state, then rank 0's weights everywhere (fit only).
        `device`: this rank's own device (the model's), where NCCL links keep their tensors; `per_node`:
        processes per node (the sub-group links: one group per node, one per local rank); `state_later`: the
        saved communication state waits for `load_state_later` (the optimizers may still cut the buckets);
        `links`: another engine's (each of a Fabric run's modules has an engine, all on one set of links),
        which that engine ends."""
        self._hand_over_plan = None  # a layout built for another fit's module
        self._for_good = None
        self._optimizer_of = {}
        log.debug(
            f"commsched: creating links {self.schedule_class.links_for(self.settings)}, "
            f"{self.schedule_class.streams_for(self.settings)} stream(s) each"
        )
        self._borrowed_links = links is not None
        if links is None and self.trace is not None:
            self.trace.clear()
        self.links = links or Links(
            self._link_specs(default_backend, world_size, per_node), timeout, self.trace, device, self.wire_dtype
        )
        self._module = module
        self._iteration_starts = True
        self._take_plan(restored, module)
        self.policy.compiled = runs_compiled(module) or self.compiled_outside
        compression = getattr(self.settings, "compression", None)
        self.policy.sparse = compression is not None and compression.method != "none"
        log.debug(f"commsched: building buckets and hooks for '{self.schedule_class.name}'")
        self.build(module, world_size)
        self._state_later = restored if state_later else None
        if restored is not None and not state_later:
            self._load(merged(restored.shared, restored.mine))
        self.links.control.broadcast_tensors([*module.parameters(), *module.buffers()], src=0, tag="initial-state")
        self.maybe_start_profiler(module)

    def _take_plan(self, restored: Optional[state.Restored], module: nn.Module) -> None:
        """The checkpoint's plan, if any; a plan file's or a checkpoint's plan must be made for this model."""
        if restored is not None:
            self.policy.load_state_dict(restored.plan)
        if self.policy.decided is not None:
            self.policy.decided.check_matches([n for n, _ in module.named_parameters()])

    def _link_specs(self, default_backend: Optional[str], world_size: int, per_node: int) -> list[LinkSpec]:
        """The links the schedule names: "primary", "secondary", and the sub-group links "intra" (the
        ranks of this node) and "inter" (the ranks with this local rank on every node), on the
        primary's backend and interface."""
        o = self._link_options
        secondary_ifname = o.secondary_interface()
        names = self.schedule_class.links_for(self.settings)
        if "secondary" in names and secondary_ifname is None:
            say(
                f"commsched: no second network interface (links.secondary_ifname or ${SECONDARY_IFNAME_ENV}): "
                "the secondary link is a second gloo group on the primary's network"
            )
        primary = o.primary_backend or default_backend
        streams = self.schedule_class.streams_for(self.settings)
        specs = {
            "primary": LinkSpec("primary", primary, o.primary_ifname, streams=streams),
            "secondary": LinkSpec("secondary", o.secondary_backend, secondary_ifname),
            "intra": LinkSpec(
                "intra", primary, o.primary_ifname, groups=node_groups(world_size, per_node), streams=streams
            ),
            "inter": LinkSpec(
                "inter", primary, o.primary_ifname, groups=local_rank_groups(world_size, per_node), streams=streams
            ),
        }
        return [specs[name] for name in names]  # names checked by register_schedule

    def build(self, module: nn.Module, world_size: int) -> None:
        assert self.links is not None
        plan = build_plan(module, world_size, self.policy.planner(), self._apart_key())
        verify_same_on_all_ranks(plan, module, self.links.control, self.schedule_class.name)
        self._serve_sparse(plan)
        self.owner = self.schedule = self.schedule_class(plan, self.links, self.settings)
        self._attach(self.owner, module)
        self._trainable = _trainable_ids(module)

    def _serve_sparse(self, plan: BucketPlan) -> None:
        """Sparse gradients (`nn.Embedding(sparse=True)`) are averaged whole at the end of each backward, as DDP
        averages them: a schedule that steps the model part by part would leave them unstepped, so WFBP runs."""
        if not plan.sparse:
            return
        names = ", ".join(n for n, _ in plan.sparse)
        name = self.schedule_class.name
        if self._compression.method != "none":
            raise CommSchedConfigError(
                f"commsched: invalid compression={self._compression.method!r} under strategy='{name}': the model has "
                f"sparse gradients ({names}), which the optimizer steps as they are (a sparse exchange's corrections "
                "would change their step); allowed here: compression='none', or dense embeddings (sparse=False)"
            )
        if self._comm_hook is not None:
            raise CommSchedConfigError(
                f"commsched: invalid ddp_comm_hook under strategy='{name}': the model has sparse gradients ({names}), "
                "which DDP's communication hooks do not take either; allowed here: ddp_comm_hook=None, or dense "
                "embeddings (sparse=False)"
            )
        self.step_whole_for_good(
            f"the model has sparse gradients ({names}), averaged whole at the end of each backward as DDP averages "
            "them and stepped as they are"
        )

    def _attach(self, schedule: Schedule, module: nn.Module) -> None:
        """What every schedule made here is told of the run (fp16's scaler, compile from outside), then hooked."""
        schedule.loss_scaler = self.loss_scaler
        schedule.compiled_outside = self.compiled_outside
        schedule.attach(module)

    def rebuild(self, module: nn.Module, world_size: int) -> None:
        """New buckets at an iteration boundary; communication state moves over by parameter name."""
        assert self.owner is not None and self.schedule is not None
        log.debug("commsched: rebuilding buckets")
        sync_enabled = self.schedule.sync_enabled
        self._take_back(module)
        self.owner.drain()
        carried = self.owner.state_dict()
        self.owner.detach()
        self._hand_over_plan = None  # the trainable parameters may have changed
        self.build(module, world_size)
        self.owner.settling = (
            self.policy.deciding or self.policy.comparing
        )  # a layout tried while deciding or checked, or the one kept
        self._load(merged(carried.get("shared", {}), carried.get("per_rank", {})))
        self.owner.sync_enabled = sync_enabled

    def mark_compiled(self, module: nn.Module, world_size: int) -> None:
        """torch.compile traces the forward from outside the module: fixed buckets, and schedules rebuilt to
        apply their updates before the compiled region rather than from hooks inside it."""
        self.compiled_outside = True
        self.policy.compiled = True
        if self.profiler is not None and self.profiler.active and not self.profiler.announce:
            self.profiler.abandon()  # started for a plan fixed buckets no longer need; its hooks would be traced
        self.rebuild(module, world_size)

    def restore(self, restored: state.Restored, module: nn.Module, world_size: int) -> None:
        """A checkpoint loaded into a running engine (Fabric loads once the module is set up): its plan
        decides the buckets, rebuilt if needed, and its communication state replaces this run's."""
        assert self.owner is not None
        self._take_back(module)
        self.owner.detach()
        if self.profiler is not None and self.profiler.active:
            self.profiler.abandon()  # steps of the run before the load; the restored policy asks again if it needs one
        self.policy = self._new_policy()  # nothing of this run's own deciding survives the checkpoint's
        self._take_plan(restored, module)
        self._hand_over_plan = None
        self.build(module, world_size)
        self._load(merged(restored.shared, restored.mine))
        self._iteration_starts = True
        self.maybe_start_profiler(module)

    def _load(self, saved: dict[str, Any]) -> None:
        assert self.owner is not None
        self.owner.load_state_dict(saved)

    def at_batch_start(self, strategy: Any) -> None:
        """Every training batch start (every rank at the same batch): profiling, re-planning, a rebuild
        when the set of trainable parameters changed (e.g. BackboneFinetuning unfreezing), and at the
        start of an iteration the schedule's own decisions and hand-overs."""
        module = strategy.lightning_module
        if self.profiler is not None:
            self.profiler.on_batch_start(strategy)
        if self._iteration_starts and strategy.root_device.type == "cuda" and self._timing_a_choice():
            compute_done(strategy.root_device)  # the choices' turns time completed steps
        if self.policy.at_boundary(strategy, self._iteration_starts):
            self.rebuild(module, strategy.world_size)
            self.policy.rebuilt(strategy)
        elif _trainable_ids(module) != self._trainable:
            self.rebuild(module, strategy.world_size)
        if self._for_good and self.schedule is self.owner:  # rebuilt: the owner must not run a single batch
            self._hand_over(self._for_good[0], module)
        if self._iteration_starts and self.owner is not None:
            self._iteration_starts = False
            self.owner.settling = self.policy.deciding or self.policy.comparing
            self._hand_over(self._for_good[0] if self._for_good else self.owner.at_boundary(), module)
        self._follow_sync()
        self.maybe_start_profiler(module)

    def _timing_a_choice(self) -> bool:
        """Some automatic choice is timing the steps now (the buckets, DeAR or WFBP, a stream search,
        sparse or dense, a recheck of any of them)."""
        deciding = self.deciding_schedule
        return self.policy.deciding or self.policy.comparing or (deciding is not None and not deciding.settled)

    @property
    def bucketed(self) -> frozenset[int]:
        """The ids of the parameters the buckets hold (those trainable when they were built)."""
        return frozenset(self._trainable)

    @property
    def deciding_schedule(self) -> Optional[Schedule]:
        """The schedule whose own choices time the steps: the owner, or the one it handed every iteration to
        for good (the owner then decides nothing)."""
        return self.schedule if self._for_good else self.owner

    def training_step_returned(self, output: Any) -> None:
        """The loss `training_step` returned goes to the schedule that chose (also while it hands its
        iterations to another): a schedule may judge its choice by it."""
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, torch.Tensor) and self.owner is not None:
            self.owner.on_loss(loss)

    def hand_over_for_good(self, handover: Handover, why: str, say_why: bool = True) -> None:
        """The owner cannot serve this run (`why`, said once unless `say_why` is False): `handover`'s schedule
        runs every iteration from the next one on, and the owner makes none of its own choices. The owner keeps
        the communication state (the running schedule, on dense buckets, keeps none across steps)."""
        if self._for_good is None and say_why:
            say(f"commsched {self.schedule_class.name}: {why}")
        self._for_good = (handover, why)

    def step_whole_for_good(self, because: str, say_why: bool = True) -> None:
        """The run steps what this schedule would step part by part in the next forward (`because`: what the
        run does, in words): a schedule that does hands every iteration to WFBP, DDP's schedule, exact with any
        number of optimizers, modules and sparse tables. Nothing for a schedule that steps the model whole."""
        if not self.schedule_class.steps_whole:
            self.hand_over_for_good(
                Handover("wfbp"),
                f"{because}, so WFBP (DDP's schedule, exact with any number of optimizers) runs every iteration",
                say_why,
            )

    @property
    def steps_whole(self) -> bool:
        """The running schedule steps the whole model at once (the configured one, or WFBP for good)."""
        return self.schedule_class.steps_whole or self._for_good is not None

    def keep_apart(self, optimizers: list[Any], module: nn.Module, world_size: int) -> None:
        """Several optimizers, each stepping its own parameters after a backward of its own (a GAN's): no bucket
        holds parameters of two of them, so that a backward of one leaves the others' buckets idle. Rebuilt
        now (at setup, every rank together); the saved state goes in after (`load_state_later`)."""
        self._optimizer_of = {id(p): i for i, o in enumerate(optimizers) for g in o.param_groups for p in g["params"]}
        self.rebuild(module, world_size)  # on every rank, whatever its buckets: the plan check is a collective

    def serve_as_part(self, module: nn.Module, world_size: int) -> None:
        """One of several modules or optimizers a Fabric loop steps by hand: DDP's fixed buckets (a planner
        times the steps of one module with one optimizer), no profile. Rebuilt now if started (every rank
        together)."""
        if self.profiler is not None and self.profiler.active:
            self.profiler.abandon()
        self._profile = dataclasses.replace(self._profile, steps=0)
        self._fusion = dataclasses.replace(self._fusion, policy="fixed")
        self.policy = self._new_policy()
        if self.owner is not None:
            self.rebuild(module, world_size)

    def load_state_later(self) -> None:
        """The saved communication state `start` kept back, into the buckets as they are now."""
        if self._state_later is not None:
            restored, self._state_later = self._state_later, None
            self._load(merged(restored.shared, restored.mine))

    def _apart_key(self) -> Optional[Any]:
        return (lambda p: self._optimizer_of.get(id(p), -1)) if self._optimizer_of else None

    def summary(self) -> list[str]:
        """What the schedules decided, for the fit's closing summary (called on every rank)."""
        assert self.owner is not None
        if self._for_good is None:
            return self.owner.summary()
        assert self.schedule is not None
        return [self._for_good[1], *(self.schedule.summary() if self.schedule is not self.owner else [])]

    def iteration_done(self) -> None:
        """After an optimizer step: the next batch starts an iteration (accumulation micro-batches do not)."""
        self._iteration_starts = True

    def _hand_over(self, handover: Optional[Handover], module: nn.Module) -> None:
        assert self.owner is not None and self.schedule is not None
        running = self.schedule
        if handover is None:
            self._take_back(module)
            return
        if running is not self.owner and running.name == handover.schedule:
            return
        self._take_back(module)
        self.owner.detach()
        self.schedule = SCHEDULES[handover.schedule](
            self._plan_for(handover.schedule, module), self.owner.links, handover.settings
        )
        self._attach(self.schedule, module)
        log.debug(f"commsched: '{self.owner.name}' hands its iterations to '{handover.schedule}'")

    def _plan_for(self, schedule: str, module: nn.Module) -> BucketPlan:
        """The buckets a hand-over runs on: the owner's, or the layout the schedule's own planner made
        (`PlanPolicy.layout_for`), built once and kept while the owner's buckets are (turns switch often)."""
        assert self.owner is not None
        layout = self.policy.layout_for(SCHEDULES[schedule].planner)
        if layout is None or layout.buckets == [list(b.names) for b in self.owner.plan.buckets]:
            return self.owner.plan
        if self._hand_over_plan is None or self._hand_over_plan[0] is not layout:
            world_size = self.owner.plan.world_size
            self._hand_over_plan = (layout, build_plan(module, world_size, layout.planner(), self._apart_key()))
        return self._hand_over_plan[1]

    def _take_back(self, module: nn.Module) -> None:
        """The owner's hooks again (a delegate's pending update is applied first)."""
        assert self.owner is not None and self.schedule is not None
        if self.schedule is self.owner:
            return
        self.schedule.flush()
        self.schedule.detach()
        self.schedule = self.owner
        self.owner.attach(module)

    def request_replan(self) -> None:
        self.policy.request_replan()
        if self.owner is not None:
            self.owner.request_replan()

    def maybe_start_profiler(self, module: nn.Module) -> None:
        """Profile the first `profile.steps` steps, and whenever a model planner needs a profile."""
        if self.profiler is not None and self.profiler.active:
            return
        planning = self.policy.wants_profile
        if not (self._profile.steps or planning):
            return
        warmup = self._fusion.profile_warmup_steps if planning else ASKED_FOR_WARMUP
        steps = max(self._profile.steps, self._fusion.profile_steps + warmup if planning else 0)
        self.profiler = RunProfiler(
            steps,
            self._profile.dir,
            self._profile.probe or planning,
            warmup=warmup,
            announce=bool(self._profile.steps),
            layers_apart=False if self.policy.compiled else None,
        )
        self.profiler.start(module, self.links)
        self._profile = dataclasses.replace(self._profile, steps=0)  # the asked-for profile runs once

    def finish_profile(self, strategy: Any) -> None:
        if self.profiler is not None and self.profiler.active:
            self.profiler.finish(strategy)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients stay local (accumulation micro-batches), on whichever schedule runs when backward does:
        a batch start inside the block (Fabric's loop starts it at the forward) may rebuild or hand over."""
        self._local = True
        self._follow_sync()
        try:
            yield
        finally:
            self._local = False
            for schedule in {id(s): s for s in (self.owner, self.schedule) if s is not None}.values():
                schedule.sync_enabled = True

    def _follow_sync(self) -> None:
        """The running schedule communicates unless inside `no_sync` (after any change of schedule)."""
        if self.schedule is not None:
            self.schedule.sync_enabled = not self._local

    def checkpoint_state(self, world_size: int, checkpoint_path: Any = None) -> dict[str, Any]:
        """Called on every rank (after a flush); rank 0's return value goes into the checkpoint, each rank's
        own state into a file beside `checkpoint_path` (`commsched.rank_parts`). After a fit has ended,
        the schedule that ran it still holds its state (residuals, plans, choices): `trainer.save_checkpoint`
        after `fit` keeps it as ModelCheckpoint's last save would."""
        owner = self.owner if self.owner is not None else self.finished
        assert owner is not None
        saved = owner.state_dict()
        per_rank = state.per_rank_saved(saved.get("per_rank", {}), world_size, checkpoint_path)
        return state.entry(owner.name, world_size, self.policy.state_dict(), saved.get("shared", {}), per_rank)

    def stop(self, destroy_links: bool) -> None:
        if self.schedule is not None and self.schedule is not self.owner:
            self.schedule.detach()
        if self.owner is not None:
            self.owner.detach()
            self.finished, self.owner, self.schedule = self.owner, None, None
        if self._borrowed_links:
            return
        if self.links is not None and destroy_links:
            self.links.destroy()
        elif self.links is not None:
            self.links.stop_issuers()


def merged(shared: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """What `Schedule.load_state_dict` receives: the shared and this rank's parts in one dict."""
    return {**shared, **mine}


def _trainable_ids(module: nn.Module) -> tuple[int, ...]:
    with torch._C.DisableTorchFunctionSubclass():  # reading requires_grad of a pending parameter is no touch
        return tuple(id(p) for p in module.parameters() if p.requires_grad)
