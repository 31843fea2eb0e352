"""The Fabric strategy: commsched's schedules under Lightning Fabric's hand-written loops.

`CommSchedFabricStrategy` subclasses Fabric's `DDPStrategy` for launching, ranks, the process group
and the distributed sampler, and never builds a `DistributedDataParallel`: `setup_module` starts the
same engine the Trainer's strategies run (links, buckets, hooks, the schedule) and wraps the module so
that its forward marks the batch boundaries. The loop's calls map onto the schedule's fixed points:

- the first forward with gradients after a backward: the batch start (plans, hand-overs, profiling),
  then `before_forward` / `after_forward` (DeAR's all-gathers land bucket by bucket in it);
- `fabric.backward(loss)`: the hooks fill the buckets; `fabric.no_backward_sync(model)` keeps them local;
- `fabric.clip_gradients` and `optimizer.step()`: the step's collectives are finished first, then the
  schedule clips and steps where its gradients are (DeAR's shards, a deferred update);
- `fabric.save` / `fabric.load`: every update applied first, the communication state saved beside the
  user's and restored into the running engine.

Several modules (a GAN's generator and discriminator set up apart) or optimizers: each module has an engine
of its own, as each has a `DistributedDataParallel` under Fabric's ddp (`commsched.runtime.fabric_parts`).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, ClassVar, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from commsched import loss_scale, rank_parts
from commsched.comm import peers
from commsched.errors import CommSchedConfigError
from commsched.options import (
    CompressionOptions,
    DeAROptions,
    DeFTOptions,
    FusionOptions,
    LinkOptions,
    PreserverOptions,
    ProfileOptions,
    StreamOptions,
    TuningOptions,
)
from commsched.runtime import refusals
from commsched.runtime.arguments import checked_arguments, refuse_unknown_arguments
from commsched.runtime.buffer_sync import BufferSync
from commsched.runtime.engine import Engine
from commsched.runtime.fabric_loop import FabricLoop, ScheduledModule
from commsched.runtime.fabric_parts import BY_PARTS, FabricPart, PartView, refuse_by_parts
from commsched.runtime.manual_optimization import every_optimizer_trainable, without_delays
from commsched.runtime.run_reports import RunReports
from commsched.say import say
from commsched.schedules import Schedule
from commsched.state import KEY, Restored, warn_if_saved_after_failure

log = logging.getLogger(__name__)

LOOP_STEPS = "fabric_steps"
"""The optimizer steps a Fabric loop had taken, beside the communication state in its checkpoint."""
OTHER_PARTS = "fabric_parts"
"""The communication state of the modules set up after the first, in the order they were set up."""


class CommSchedFabricStrategy(RunReports, DDPStrategy):
    """Data-parallel training with a communication schedule under Fabric (`schedule=` one of `SCHEDULES`)."""

    strategy_name = "commsched"
    default_schedule: ClassVar[str] = "dear"

    def __new__(cls, *args: Any, **kwargs: Any) -> "CommSchedFabricStrategy":
        refuse_unknown_arguments(cls, kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        schedule: Optional[str] = None,
        fusion: Union[str, FusionOptions] = "auto",
        bucket_cap_mb: Optional[float] = None,
        tuning: Optional[TuningOptions] = None,
        profile: Optional[ProfileOptions] = None,
        links: Optional[LinkOptions] = None,
        deft: Optional[DeFTOptions] = None,
        preserver: Optional[PreserverOptions] = None,
        compression: Union[str, CompressionOptions, None] = None,
        streams: Union[str, StreamOptions, None] = None,
        dear: Optional[DeAROptions] = None,
        schedule_options: Any = None,
        comm_dtype: str = "fp32",
        ddp_comm_hook: Optional[Callable[..., Any]] = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Optional[Callable[..., Any]] = None,
        broadcast_buffers: bool = True,
        trace_collectives: bool = False,
        timeout: Optional[timedelta] = default_pg_timeout,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        """The arguments of the Trainer's `commsched.CommSchedStrategy`, with the same checks and meanings
        (``precision`` is Fabric's plugin). Under Fabric, deft runs plans without delay: the guard of delayed
        plans (`commsched.Preserver`) is a Trainer callback, and a Fabric loop has no callbacks to run it."""
        configured = checked_arguments(
            type(self).__name__,
            schedule or self.default_schedule,
            fusion,
            bucket_cap_mb,
            tuning,
            profile,
            links,
            deft,
            preserver,
            compression,
            streams,
            dear,
            schedule_options,
            comm_dtype,
            ddp_comm_hook,
            ddp_comm_state,
            ddp_comm_wrapper,
            broadcast_buffers,
            trace_collectives,
            timeout,
            start_method,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=configured.timeout,
            start_method=configured.start_method,  # type: ignore[arg-type]
        )
        if configured.hook_read is not None:
            say(f"commsched: {configured.hook_read}")
        self.schedule_class: type[Schedule] = configured.schedule_class
        self.options = without_delays(configured.options)
        if self.schedule_class.name == "deft" and configured.options.deft.capacity is not None:
            say(
                "commsched deft: under Fabric, plans without delay (the guard of delayed plans reads the Trainer's "
                "steps); DeFT still chooses between WFBP, DeAR and its plan on the two links"
            )
        self._engine = Engine(self.schedule_class, self.options, configured.trace_collectives)
        """The first module's engine (the one the run's reports read); it makes and ends the links."""
        self._broadcast_buffers = configured.broadcast_buffers
        self._backward_sync_control = _ScheduleSyncControl(self)
        self.optimizers: list[Optimizer] = []
        """The optimizers set up, in order."""
        self.loop = FabricLoop(self)
        """The loop as the engine reads it (a Trainer under the Trainer's strategies)."""
        self.run_dir = None  # Fabric writes no files of its own: neither does commsched, unless asked by name
        self.run_dir_resolved = True
        self._parts: list[FabricPart] = []
        """The modules set up, in order, each with its engine (the first's is `_engine`)."""
        self._by_parts = False  # several modules or optimizers: `fabric_parts`
        self._said_hand_over = False
        self._evaluating = False  # the forward running has no gradients

    @property
    def lightning_module(self) -> Optional[nn.Module]:
        """The module trained (the user's, unwrapped; the first set up), under the name the engine reads."""
        return self._parts[0].module if self._parts else None

    def request_replan(self) -> None:
        """Decide the fusion plan (and DeFT's plan) again from the next batch on (all ranks must ask together)."""
        for engine in self._engines():
            engine.request_replan()

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        peers.learn()  # collective: a failed collective can then name the rank that is gone

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        self._refuse_optimizers([*self.optimizers, *optimizers])
        wrapped = self.setup_module(module)
        for optimizer in optimizers:
            self._add_optimizer(optimizer)
        return wrapped, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """`fabric.setup_optimizers` after `fabric.setup_module`: it steps the modules whose parameters it holds."""
        self._refuse_optimizers([*self.optimizers, optimizer])
        self._add_optimizer(optimizer)
        return optimizer

    def _add_optimizer(self, optimizer: Optimizer) -> None:
        self.optimizers.append(optimizer)
        for part in self._parts:
            if part.steps(optimizer):
                part.optimizers.append(optimizer)
        if len(self.optimizers) > 1:
            self._enter_parts()

    def _refuse_optimizers(self, optimizers: list[Optimizer]) -> None:
        name = self.schedule_class.name
        refusals.refuse_optimizer_setup(optimizers, name, self.schedule_class.steps_whole, by_hand=True)
        self.schedule_class.refuse_optimizers(self.options, optimizers)
        refusals.refuse_under_scaler(
            loss_scale.scaler_of(self.precision), optimizers, name, self.schedule_class.steps_whole, self.options
        )

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Links, buckets and hooks instead of a DistributedDataParallel wrapper; rank 0's weights everywhere.
        A module set up after the first gets an engine of its own on the first's links."""
        self._refuse_module(module)
        log.debug(f"{type(self).__name__}: starting schedule '{self.schedule_class.name}' for {type(module).__name__}")
        first = not self._parts
        if not first or len(self.optimizers) > 1:
            self._enter_parts()
        engine = self._engine if first else Engine(self.schedule_class, self.options, trace_collectives=False)
        part = FabricPart(module, engine, BufferSync(self._broadcast_buffers))
        part.optimizers = [o for o in self.optimizers if part.steps(o)]  # `fabric.setup_optimizers` may come first
        engine.settings = self.schedule_class.settings_for(self.options, self.loop, lambda: None)
        engine.loss_scaler = loss_scale.scaler_of(self.precision)
        if self._by_parts:
            engine.serve_as_part(module, self.world_size)
        engine.start(
            module,
            self.world_size,
            self._timeout,
            self._process_group_backend,
            None,
            self.root_device,
            self.num_processes,
            links=None if first else self._engine.links,
        )
        self._parts.append(part)
        if self._by_parts:
            self._hand_over(part.engine)
        return ScheduledModule(module, self)

    def _refuse_module(self, module: nn.Module) -> None:
        """Set up once, with something to average, sharing no parameter with a module set up before."""
        if any(part.module is module for part in self._parts):
            raise CommSchedConfigError(
                f"commsched: {type(module).__name__} was already set up with this Fabric; set up each module once"
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise CommSchedConfigError(
                f"commsched: {type(module).__name__} has no parameter that requires a gradient: there is nothing to "
                "average (Fabric's ddp refuses it too). A frozen module (a teacher) needs no strategy: move it with "
                "fabric.to_device(module)"
            )
        earlier = {id(p): part for part in self._parts for p in part.module.parameters()}
        shared = [(name, earlier[id(p)]) for name, p in module.named_parameters() if id(p) in earlier]
        if shared:
            name, part = shared[0]
            raise CommSchedConfigError(
                f"commsched: {type(module).__name__} shares {len(shared)} parameter(s) (e.g. '{name}') with "
                f"{type(part.module).__name__}, set up before it: each module set up has its own buckets, and a "
                "parameter cannot be in two. Set up one module holding both (or give each its own parameters)."
            )

    def _enter_parts(self) -> None:
        """Several modules or optimizers from here on (`commsched.runtime.fabric_parts`): every part on DDP's
        fixed buckets, handed to WFBP where the schedule steps the model part by part (said once)."""
        if self._by_parts:
            return
        refuse_by_parts(self.options, self.schedule_class.name, "several modules or optimizers set up")
        self._by_parts = True
        for part in self._parts:
            if part.engine.schedule is not None:
                part.engine.schedule.flush()
            part.engine.serve_as_part(part.module, self.world_size)
            self._hand_over(part.engine)

    def _hand_over(self, engine: Engine) -> None:
        engine.step_whole_for_good(BY_PARTS, say_why=not self._said_hand_over)
        self._said_hand_over = True

    def _part_of(self, module: nn.Module) -> FabricPart:
        unwrapped = module.module if isinstance(module, ScheduledModule) else module
        for part in self._parts:
            if part.module is unwrapped:
                return part
        raise CommSchedConfigError(
            f"commsched: {type(unwrapped).__name__} was not set up with this Fabric (fabric.setup(module))"
        )

    # --------------------------------------------------------------- the loop
    @torch.compiler.disable
    def forward_starts(self, module: nn.Module, traced: bool) -> None:
        """Before the module's forward: with gradients, a training forward (the first after a backward
        starts the module's batch); without, an evaluation that sees every update. `traced`: torch.compile is
        tracing the wrapper (the module was given to `fabric.setup` compiled): the schedule runs as under
        compile."""
        part = self._part_of(module)
        engine = part.engine
        if engine.schedule is None:
            return
        if traced and not engine.compiled_outside:
            engine.mark_compiled(module, self.world_size)
        self._evaluating = not torch.is_grad_enabled()
        if self._evaluating:
            engine.schedule.flush()
            part.buffers.before_forward(module, self.control_link)
            return
        if not part.batch_open:
            part.batch_open = True
            with every_optimizer_trainable(self.optimizers if self._by_parts else (), engine.bucketed):
                engine.at_batch_start(PartView(self, part) if self._by_parts else self)
        schedule = engine.schedule
        assert schedule is not None
        self._profile("phase_started")
        part.buffers.before_forward(module, self.control_link)
        schedule.before_forward()

    @torch.compiler.disable
    def forward_ends(self, module: nn.Module) -> None:
        part = self._part_of(module)
        schedule = part.engine.schedule
        if schedule is None:
            return
        if not self._evaluating:
            schedule.after_forward()
        part.buffers.after_forward(schedule.sync_enabled)
        if not self._evaluating:
            self._profile("forward_done")

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if not self._parts or self._engine.schedule is None:
            return super().backward(tensor, module, *args, **kwargs)
        if self._by_parts:
            return self._backward_by_parts(tensor, module, *args, **kwargs)
        part, schedule = self._parts[0], self._engine.schedule
        self._engine.training_step_returned(tensor)  # the loss: a schedule may judge its choices by it
        self._profile("backward_started")
        super().backward(tensor, module, *args, **kwargs)
        self._profile("backward_done")
        part.batch_open = False
        part.backward_pending = part.backward_pending or schedule.sync_enabled

    def _backward_by_parts(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """As under Fabric's ddp, where each module has its own `DistributedDataParallel`: the gradients of
        every module this backward reached are averaged when it returns; a module it did not reach waits."""
        super().backward(tensor, module, *args, **kwargs)
        for part in self._parts:
            part.batch_open = False
            schedule = part.engine.schedule
            if schedule is not None and schedule.capture.launched:
                schedule.finish_backward()

    def _finish_backward(self, part: FabricPart, schedule: Schedule) -> None:
        """Before clipping or stepping: every collective of the step was issued on every rank."""
        if part.backward_pending:
            part.backward_pending = False
            schedule.finish_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        schedule = self._engine.schedule
        if schedule is None or not self._parts:
            return super().optimizer_step(optimizer, **kwargs)
        if self._by_parts:
            stepped = [part for part in self._parts if any(o is optimizer for o in part.optimizers)]
            try:
                return super().optimizer_step(optimizer, **kwargs)  # `.grad` holds the averaged gradients
            finally:
                self._stepped(stepped)
        part = self._parts[0]
        self._finish_backward(part, schedule)
        try:
            with loss_scale.answered_by(self._engine.loss_scaler, schedule.unscale_gradients):
                return schedule.optimizer_step(optimizer, lambda: self.precision.optimizer_step(optimizer, **kwargs))
        finally:
            self._stepped([part])

    def _stepped(self, parts: list[FabricPart]) -> None:
        for part in parts:
            part.engine.iteration_done()
            part.batch_open = False
        self.loop.global_step += 1

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The global norm of the averaged gradients, wherever the schedule holds them (DeAR: its shards)."""
        schedule = self._engine.schedule
        if schedule is None or self._by_parts:  # by parts, `.grad` holds the averaged gradients
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise CommSchedConfigError(
                f"commsched: invalid fabric.clip_gradients(norm_type={norm_type!r}) under strategy "
                f"'{self.schedule_class.name}'; allowed: 2.0 (the norm every schedule computes where it holds the "
                "gradients), or clip_val=... to clip by value"
            )
        self._unscale(schedule, optimizer)
        norm = schedule.clip_gradients(optimizer, float(max_norm), "norm")
        assert norm is not None, "clipping by norm returns the total norm"
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        schedule = self._engine.schedule
        if schedule is None or self._by_parts:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._unscale(schedule, optimizer)
        schedule.clip_gradients(optimizer, float(clip_val), "value")

    def _unscale(self, schedule: Schedule, optimizer: Optimizer) -> None:
        """fp16's scaler unscales before clipping (the schedule answers where it holds the gradients)."""
        self._finish_backward(self._parts[0], schedule)
        with loss_scale.answered_by(self._engine.loss_scaler, schedule.unscale_gradients):
            self.precision.unscale_gradients(optimizer)

    def _profile(self, event: str) -> None:
        if self._engine.profiler is not None:
            getattr(self._engine.profiler, event)(self)

    # ------------------------------------------------------------ checkpoints
    def _flush(self) -> None:
        for engine in self._engines():
            if engine.schedule is not None:
                engine.schedule.flush()

    def _engines(self) -> list[Engine]:
        """Every module's engine, in setup order (the first's alone before any module is set up)."""
        return [part.engine for part in self._parts] or [self._engine]

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return super().get_module_state_dict(module.module if isinstance(module, ScheduledModule) else module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        unwrapped = module.module if isinstance(module, ScheduledModule) else module
        super().load_module_state_dict(unwrapped, state_dict, strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        saved, owner = super().get_optimizer_state(optimizer), self._engine.owner
        if owner is None or self._by_parts:  # by parts, WFBP on dense gradients: the optimizer's own state
            return saved
        return owner.optimizer_state(optimizer, saved)

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Called on every rank (`fabric.save`): every update applied, then the communication state saved
        beside the user's objects under ``"commsched"`` (each rank's own part in a file beside the checkpoint)."""
        if self._engine.owner is not None:
            self._flush()
            saved = self._engine.checkpoint_state(self.world_size, path)
            saved[LOOP_STEPS] = self.loop.global_step
            if len(self._parts) > 1:
                saved[OTHER_PARTS] = [
                    part.engine.checkpoint_state(self.world_size) for part in self._parts[1:]
                ]  # where step-driven phases are (top-k's density warm-up)
            state = {**state, _free_key(state): saved}
        try:
            super().save_checkpoint(path, state, storage_options, filter)
        except BaseException:
            rank_parts.discard(path, state.get(KEY))
            raise
        if self.is_global_zero and KEY in state:  # the checkpoint names its parts: older saves' go
            rank_parts.keep_only(path, state[KEY].get(rank_parts.PARTS_KEY))

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """`fabric.load`: the weights and optimizer as Fabric loads them, then the communication state into
        the running engine (refused with a message where this run cannot take it: another world size
        with per-rank state, another schedule with delayed gradients)."""
        self._flush()  # a pending update must not land on the loaded weights
        remaining = super().load_checkpoint(path, state, strict, weights_only)
        if isinstance(state, (nn.Module, Optimizer)) or self._engine.owner is None:
            return remaining
        saved = remaining.pop(KEY, None)
        if saved is not None:
            self.loop.global_step = saved.pop(LOOP_STEPS, 0)
            others = saved.pop(OTHER_PARTS, [])
            if len(others) != len(self._parts) - 1:
                raise CommSchedConfigError(
                    f"commsched: fabric.load({path!r}): the checkpoint holds the communication state of "
                    f"{len(others) + 1} module(s) set up, this run set up {len(self._parts)}; set up the same "
                    "modules, in the same order, as the run that saved it"
                )
            for part, entry in zip(self._parts, [saved, *others]):
                checkpoint = {KEY: entry}
                warn_if_saved_after_failure(checkpoint)
                rank_path = path if part is self._parts[0] else None
                restored = Restored(checkpoint, self.schedule_class.name, self.global_rank, self.world_size, rank_path)
                part.engine.restore(restored, part.module, self.world_size)
                part.batch_open = part.backward_pending = False
        return remaining

    @override
    def teardown(self) -> None:
        log.debug(f"{type(self).__name__}: tearing down schedule and links")
        for engine in reversed(self._engines()):  # the first engine's links end last
            if engine.schedule is not None:
                engine.schedule.drain()
            engine.stop(destroy_links=True)
        self._parts = []
        self.optimizers = []
        self._by_parts = self._said_hand_over = False
        super().teardown()


def _free_key(user_state: dict[str, Any]) -> str:
    """The key the communication state is saved under, refused where the user's state already has it."""
    if KEY in user_state:
        raise CommSchedConfigError(
            f"commsched: fabric.save(path, state) with a key {KEY!r}: that key holds the communication "
            "state commsched saves beside yours; name your entry otherwise"
        )
    return KEY


class _ScheduleSyncControl(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: accumulation micro-batches keep that module's gradients local."""

    def __init__(self, strategy: CommSchedFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._strategy._part_of(module).engine.no_sync() if enabled else nullcontext()
