"""`commsched.Schedule`, the public base class of every schedule: capture -> reduce -> route -> apply.

- capture (`GradientCapture`): hooks fill the bucket buffers and hand complete buckets on in order;
- reduce: a reducer object per bucket (`commsched.reducers`) says how its bytes are combined;
- route: the schedule decides which link carries each bucket and when (this backward, the next
  forward, a later iteration);
- apply: the schedule decides when the optimizer sees the result.

A new schedule is one file: a subclass (of this class or of a built-in one, e.g.
``commsched.SCHEDULES["wfbp"]``) registered with `commsched.register_schedule`. It is then
available by name in ``Trainer(strategy=...)``, Hydra's ``schedule=``, the profiler, the bench and
the simulator. A schedule talks to Lightning only through the strategy, which calls the methods
below at fixed points of the loop; everything it keeps across steps is its communication state
(`state_dict`), saved in checkpoints by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Iterable, Optional, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from commsched.comm.buckets import BucketPlan
from commsched.comm.link_groups import Links
from commsched.reducers import Reducer, ReducerState
from commsched.schedules.capture import GradientCapture
from commsched.state import refuse_unknown

if TYPE_CHECKING:
    from commsched.interleaved import MeasuredChoice
    from commsched.options import StrategyOptions
    from commsched.reducers.units import Striping
    from commsched.sim.cost_models import CostModel
    from commsched.sim.timelines import Buckets, Result
    from commsched.sim.workload import Workload
    from commsched.streams.control import StreamControl


SettingsT = TypeVar("SettingsT")
"""What `settings_for` builds and the schedule reads as ``self.settings`` (``Schedule[MySettings]``)."""


@dataclass(frozen=True)
class Handover:
    """A schedule asks the engine to run its iterations with another registered schedule on the same
    buckets (DeFT, after measuring, when an exact schedule is faster); `settings` are that schedule's."""

    schedule: str
    settings: Any = None


def _hands_over_options(cls: type) -> bool:
    """True when `cls.settings_for` is the base one, which hands the schedule its own options as they are."""
    return cls.settings_for.__func__ is Schedule.settings_for.__func__  # type: ignore[attr-defined]


class Schedule(Generic[SettingsT]):
    """Base class of every schedule. The extension surface is its public methods: a subclass implements
    `on_bucket_ready(b)` and `on_backward_end()` (marked `@override`, as the built-in schedules do) and
    may override any other public method; everything else has a default. The type parameter is its
    settings' type (``class Mine(Schedule[MineOptions])``): what ``self.settings`` holds."""

    name: ClassVar[str] = "base"
    """The name users pick it by (``Trainer(strategy=name)``, ``schedule=name``)."""
    description: ClassVar[str] = ""
    links_used: ClassVar[tuple[str, ...]] = ("primary",)
    """The links (`commsched.comm.links`) this schedule communicates over, created at setup on every rank."""
    step_collectives: ClassVar[tuple[str, ...]] = ()
    """The collectives one step issues per bucket (the profiler times exactly these)."""
    mask_link: ClassVar[str] = "primary"
    """The link of the per-step used-mask all-reduce ("control": the default group, when the primary
    carries traffic that must not be waited for at the end of backward)."""
    planner: ClassVar[str] = "mgwfbp"
    """The model policy that plans this schedule's buckets under ``fusion="auto"`` (a
    `commsched.fusion.MODEL_POLICIES` name)."""
    hands_over_to: ClassVar[tuple[str, ...]] = ()
    """The schedules `at_boundary` may hand the iterations to (`Handover`): under ``fusion="auto"`` each
    runs on the layout its own planner makes from the same profile where the run's own plan beat fixed
    buckets on real steps, and on the run's buckets otherwise (`PlanPolicy.layout_for`)."""
    compresses: ClassVar[bool] = False
    """True: the schedule builds sparse reducers when the strategy's `compression` asks for them."""
    stripes: ClassVar[bool] = False
    """True: the schedule spreads its buckets' units over `streams` (`commsched.streams`)."""
    steps_whole: ClassVar[bool] = True
    """True: `optimizer.step()` runs once per step with every gradient in place on every rank (an
    optimizer may issue its own collectives there, e.g. `commsched.optim.LARS`'s parallel norms)."""
    runs_comm_hooks: ClassVar[bool] = False
    """True: a DDP communication hook (``ddp_comm_hook``) may replace the all-reduce of each whole bucket."""
    skips_steps: ClassVar[bool] = False
    """True: some iterations take no optimizer step (`steps_this_iteration` says how many were taken);
    per-step LR schedulers then follow the optimizer steps, not the iterations."""

    options_class: ClassVar[Optional[type]] = None
    """The dataclass of this schedule's own options, torch-free, a default and a docstring per field (a
    field's check goes in ``metadata["check"]``, as in `commsched.options`). The strategy takes an
    instance as ``schedule_options=`` and validates it; ``commsched-train`` gives it a node named after
    the schedule (``NAME.FIELD=value``); `settings_for` hands it to the schedule by default. None: no
    options of its own."""

    def __init__(self, plan: BucketPlan, links: Links, settings: Optional[SettingsT] = None) -> None:
        self.plan = plan
        self.links = links
        if settings is None and self.options_class is not None and _hands_over_options(type(self)):
            settings = self.options_class()  # built directly (tests, the simulator): the options' defaults
        self.settings: SettingsT = settings  # type: ignore[assignment]  # None for a schedule with no settings
        self.steps_this_iteration = 1
        self.link = links["primary"]
        mask_link = links.control if self.mask_link == "control" else links[self.mask_link]
        self.capture = GradientCapture(plan, mask_link, self.name, self.on_bucket_ready, self.on_backward_end)
        self.reducers: list[Reducer] = []
        """One per bucket, if the schedule combines buckets with reducers: their state is saved with the schedule's."""
        self.streams: Optional[StreamControl] = None
        """Schedules that spread buckets over streams (`stripes`): the configuration, fixed or searched;
        its decision is saved with the schedule's state."""
        self._handles: list[RemovableHandle] = []
        self.module: Optional[nn.Module] = None
        """The module trained, once attached."""
        self.loss_scaler: Any = None
        """fp16's GradScaler (Lightning's "16-mixed"), set by the engine; None without one."""
        self.compiled_outside = False
        """torch.compile wraps what calls the module (`runs_compiled` cannot see it there): set by the engine."""
        self.settling = False
        """True while the engine still decides the buckets (`fusion="auto"`): searches that time steps
        (streams, sparse or dense) wait, so that two choices never read each other's changes."""

    @property
    def sync_enabled(self) -> bool:
        return self.capture.sync_enabled

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self.capture.sync_enabled = value

    # ----------------------------------------------------------------- lifecycle
    def attach(self, module: nn.Module) -> None:
        """Install hooks on `module` (at setup, after a rebuild, when taking iterations back)."""
        self.module = module
        self.capture.attach()

    def detach(self) -> None:
        self.capture.detach()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def after_failure(self) -> Optional[str]:
        """After a failed run (a peer died, a collective failed): what the model holds, in a sentence,
        where it is not simply the weights of the last step taken (nothing to say: None)."""
        return None

    # ------------------------------------------------------------ what a subclass implements
    def on_bucket_ready(self, b: int) -> None:
        """Bucket `b` is full: every gradient of it was written into its buffer, scaled by 1/world size.
        Called during backward, once per bucket per step, in the plan's order (the same on every rank),
        so the collectives a schedule issues here line up across ranks. Start the bucket's exchange
        here to overlap it with the rest of backward (WFBP), or only part of it (DeAR's reduce-scatter)."""
        raise NotImplementedError

    def on_backward_end(self) -> None:
        """Every bucket was handed to `on_bucket_ready` and the used-parameter mask is known; still inside
        autograd's backward, before Lightning's optimizer step. Finish what must be finished before the
        step (wait, then `hand_back_gradients`), or leave it in flight for later (DeAR's all-gathers)."""
        raise NotImplementedError

    def skips_idle_buckets(self) -> bool:
        """True: a backward that no rank can fill some buckets in (`GradientCapture.agree_on_idle`: a GAN's
        backward of one half) sends nothing for them, and `on_bucket_ready` never sees them. False (here):
        every bucket is handed on every backward, zeros included, as DDP sends them."""
        return False

    def hand_back_gradients(self, buckets: Iterable[int]) -> None:
        """`.grad` of each parameter of `buckets` becomes a view of its averaged gradient in the bucket
        (None where no rank produced one this step, so the optimizer skips it), as DDP leaves them."""
        self.capture.hand_back(buckets)

    # ------------------------------------------------- called by the strategy
    def at_boundary(self) -> Optional[Handover]:
        """The start of an iteration (every rank at the same batch, before `training_step`): the place
        for decisions that issue collectives. A `Handover` gives the iterations to another schedule."""
        return None

    def finish_backward(self) -> None:
        """After Lightning's closure: every collective of this step was issued on every rank."""
        self.capture.finish()
        self.capture.reset()

    def optimizer_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        """Run Lightning's precision-plugin step (closure, hooks, clipping, `optimizer.step`)."""
        return run_step()

    def unscale_gradients(self, optimizer: Optimizer, inv_scale: torch.Tensor) -> Optional[torch.Tensor]:
        """fp16's GradScaler unscales after the closure (`commsched.loss_scale`). None: the averaged
        gradients are whole in `.grad` and torch's scaler unscales them itself. A schedule that holds them
        elsewhere unscales them there and returns the found-inf flag (1.0 where any rank's gradient has an
        inf or a NaN) agreed on every rank (`agreed`)."""
        return None

    def agreed(self, found: torch.Tensor) -> torch.Tensor:
        """This rank's found-inf flag made every rank's: one scalar all-reduce on the control link."""
        control = self.links.control
        flag = found.reshape(1).to(control.device, torch.float32)
        control.all_reduce(flag, "found-inf").wait()
        return flag.clamp(max=1.0).reshape(()).to(found.device)

    def before_forward(self) -> None:
        """Start of a training step, before the user's `training_step` runs."""

    def after_forward(self) -> None:
        """The user's `training_step` returned; backward has not started."""

    def on_loss(self, loss: torch.Tensor) -> None:
        """The loss `training_step` returned (each micro-batch, before any callback sees it): for schedules
        that judge their own choices by it. Read it without waiting (`.detach()`, no `.item()`): the
        forward may still run on the device."""

    def flush(self) -> None:
        """Bring every parameter up to date: nothing in flight, no update pending."""

    def request_replan(self) -> None:
        """The user asked for a new plan (`strategy.request_replan()`); schedules with plans of their own redo them."""

    def drain(self) -> None:
        """End of training, or buckets about to be rebuilt: also apply whatever a schedule keeps back
        on purpose (DeFT's delayed gradients). Called on every rank at the same point."""
        self.flush()

    @classmethod
    def keeps_its_buckets(cls, options: StrategyOptions) -> bool:
        """True: with these options the buckets must stay as built (e.g. timings given per bucket),
        so `fusion="auto"` keeps fixed buckets."""
        return False

    @classmethod
    def links_for(cls, settings: Any) -> tuple[str, ...]:
        """The links this schedule needs with these settings (default: `links_used`)."""
        return cls.links_used

    @classmethod
    def streams_for(cls, settings: Any) -> int:
        """Streams (process groups) of each of this schedule's links (primary, intra, inter) to make at setup
        (a stream search makes more as it tries them)."""
        control = getattr(settings, "streams", None)
        return control.streams_at_setup if control is not None else 1

    def _restripe(self, striping: "Striping") -> None:
        """Build the reducers for another stream configuration (between iterations)."""
        raise NotImplementedError

    def _follow_streams(self) -> None:
        """At an iteration start: the stream search's switch, if any; once it has settled, the groups
        the kept configuration does not use are released (a search may have made 16 of each link, and
        an idle gloo group costs its process about 1 ms of CPU a second, polling its connections)."""
        assert self.streams is not None
        chosen = self.streams.at_boundary(self.links.control, hold=self.settling)
        if chosen is not None:
            self._restripe(chosen)
        if self.streams.auto and not self.streams.searching:
            s = self.streams.striping
            two_level = s.streams if s.hierarchical else 0  # the node-first links, made again if a search re-opens
            self.links.release_streams(
                {"primary": 1 if s.hierarchical else s.streams, "intra": two_level, "inter": two_level}
            )

    @classmethod
    def refuse_optimizers(cls, options: StrategyOptions, optimizers: list[Optimizer]) -> None:
        """Raise `CommSchedConfigError` when these options cannot serve the run's optimizers (checked at
        setup, once the optimizers exist, before any step)."""

    @classmethod
    def settings_for(cls, options: StrategyOptions, trainer: Any, advance_schedulers: Callable[[], None]) -> Any:
        """Schedule-specific settings built from the strategy's options and the Trainer. Default: the
        schedule's own options (`options_class`) as validated, None when it declares none."""
        return options.schedule_options

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: str) -> Optional[torch.Tensor]:
        """Lightning's gradient clipping (``"norm"`` or ``"value"``), on the averaged gradients wherever they
        are; by norm, the total norm before clipping (as `torch.nn.utils.clip_grad_norm_` returns it)."""
        if algorithm == "value":
            self.clip_grad_value(optimizer, clip_val)
            return None
        return self.clip_grad_norm(optimizer, clip_val)

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params_of(optimizer), max_norm)

    def clip_grad_value(self, optimizer: Optimizer, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(params_of(optimizer), clip_value)

    # ---------------------------------------------------- communication state
    @property
    def settled(self) -> bool:
        """Every choice this schedule makes on timed steps is made (a stream search, sparse or dense, ...):
        from here on its steps are its steady state (benchmarks time them)."""
        return self.streams is None or not self.streams.searching

    def summary(self) -> list[str]:
        """What this schedule decided, for the fit's closing summary (called on every rank at the end
        of a completed fit; a subclass adds its own lines to these)."""
        line = self.streams.finish() if self.streams is not None else None
        return [line] if line else []

    def optimizer_state(self, optimizer: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's `state_dict()` as a checkpoint holds it (called on every rank, after `flush`):
        a schedule that keeps part of the optimizer's state itself (DGC's velocities) puts it back
        where a run under another strategy reads it. Here: as it is."""
        return saved

    def state_dict(self) -> dict[str, Any]:
        """What this schedule keeps across steps (called after `flush`, so nothing is in flight):
        ``{"shared": {...}, "per_rank": {...}}``, the first equal on every rank, the second not
        (see `commsched.state`); tensors keyed by parameter name, never by bucket. {} if nothing.
        Here: the reducers' state, per rank."""
        kept: ReducerState = {}
        for reducer in self.reducers:
            for kind, entries in reducer.state_dict().items():
                kept.setdefault(kind, {}).update(entries)
        saved: dict[str, Any] = {"per_rank": {"reducers": kept}} if kept else {}
        shared: dict[str, Any] = {}
        streams = self.streams.state_dict() if self.streams is not None else {}
        if streams:
            shared["streams"] = streams
        choices = {name: choice.state_dict() for name, choice in self.choices().items()}
        if choices:
            shared["choices"] = choices
        if shared:
            saved["shared"] = shared
        return saved

    def choices(self) -> dict[str, "MeasuredChoice"]:
        """The choices this schedule makes on timed steps (`commsched.interleaved.MeasuredChoice`), by name: their
        verdicts and later checks are communication state, so a resumed run keeps what it decided."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore into freshly built buckets (a resume, a rebuild, a re-plan): `state` is the shared
        and this rank's parts of an earlier `state_dict()` merged into one dict. A schedule must
        refuse (`CommSchedConfigError`) state it cannot take rather than drop it: here, reducer state
        of a kind no reducer of this run keeps (residuals of a compression this run does not use)."""
        refuse_unknown(self.name, state, ("reducers", "streams", "choices"))
        if self.streams is not None and self.streams.load_state_dict(state.get("streams")):
            self._restripe(self.streams.striping)
        saved_choices = state.get("choices", {})
        for name, choice in self.choices().items():
            choice.load_state_dict(saved_choices.get(name))
        saved = state.get("reducers", {})
        kept = {kind for reducer in self.reducers for kind in reducer.kinds}
        refuse_unknown(self.name, saved, kept)
        for reducer in self.reducers:
            reducer.load_state_dict(saved)

    # ------------------------------------------------------------------ models
    @classmethod
    def theoretical_best(cls, t_ff: float, t_bp: float, totals: dict[str, float]) -> float:
        """Best step (forward + backward + communication) this schedule allows for the measured times.
        Default: nothing overlaps, its `step_collectives` after backward."""
        return t_ff + t_bp + sum(totals.get(c, 0.0) for c in cls.step_collectives)

    @classmethod
    def simulate(cls, workload: "Workload", network: "CostModel", workers: int, buckets: "Buckets") -> "Result":
        """One steady iteration on the simulator's timeline. Default: forward, backward, then this
        schedule's collectives of every bucket one after another (no overlap, the bound above)."""
        from commsched.sim.timelines import after_backward

        return after_backward(cls.name, workload, network, workers, buckets, cls.step_collectives)


def runs_compiled(module: nn.Module) -> bool:
    """The module, or one of its submodules, runs under torch.compile: Lightning's
    ``trainer.fit(torch.compile(model))`` marks the LightningModule (`_compiler_ctx`), a compiled
    submodule is an `OptimizedModule`, and `nn.Module.compile()` compiles in place."""
    if getattr(module, "_compiler_ctx", None):
        return True
    from torch._dynamo.eval_frame import OptimizedModule

    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )


def params_of(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]
