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
from commsched.runtime.manual_optimization import without_delays
from commsched.runtime.run_reports import RunReports
from commsched.say import say
from commsched.schedules import Schedule
from commsched.state import KEY, Restored, warn_if_saved_after_failure

log = logging.getLogger(__name__)

LOOP_STEPS = "fabric_steps"
"""The optimizer steps a Fabric loop had taken, beside the communication state in its checkpoint."""


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
        self._buffers = BufferSync(configured.broadcast_buffers)
        self._backward_sync_control = _ScheduleSyncControl(self._engine)
        self.optimizers: list[Optimizer] = []
        """The optimizers set up with the module (a schedule steps exactly one)."""
        self.loop = FabricLoop(self)
        """The loop as the engine reads it (a Trainer under the Trainer's strategies)."""
        self.run_dir = None  # Fabric writes no files of its own: neither does commsched, unless asked by name
        self.run_dir_resolved = True
        self._module: Optional[nn.Module] = None
        self._batch_open = False  # a forward with gradients ran since the last backward: the batch has started
        self._evaluating = False  # the forward running has no gradients
        self._backward_pending = False  # a synchronised backward ran; its collectives are not finished yet

    @property
    def lightning_module(self) -> Optional[nn.Module]:
        """The module trained (the user's, unwrapped), under the name the engine reads on every strategy."""
        return self._module

    def request_replan(self) -> None:
        """Decide the fusion plan (and DeFT's plan) again from the next batch on (all ranks must ask together)."""
        self._engine.request_replan()

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        peers.learn()  # collective: a failed collective can then name the rank that is gone

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        self._refuse_optimizers(optimizers)
        self.optimizers = list(optimizers)
        return self.setup_module(module), optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """`fabric.setup_optimizers` after `fabric.setup_module`: the schedule steps this optimizer."""
        self._refuse_optimizers([*self.optimizers, optimizer])
        self.optimizers.append(optimizer)
        return optimizer

    def _refuse_optimizers(self, optimizers: list[Optimizer]) -> None:
        name = self.schedule_class.name
        refusals.refuse_optimizer_setup(optimizers, name, self.schedule_class.steps_whole)
        self.schedule_class.refuse_optimizers(self.options, optimizers)
        refusals.refuse_under_scaler(
            loss_scale.scaler_of(self.precision), optimizers, name, self.schedule_class.steps_whole, self.options
        )

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Links, buckets and hooks instead of a DistributedDataParallel wrapper; rank 0's weights everywhere."""
        if self._module is not None:
            raise CommSchedConfigError(
                f"commsched: {type(self).__name__} trains one module per Fabric; this one was already set up with "
                f"{type(self._module).__name__}. Set up one model (a module holding the others trains them together)."
            )
        log.debug(f"{type(self).__name__}: starting schedule '{self.schedule_class.name}'")
        self._module = module
        self._engine.settings = self.schedule_class.settings_for(self.options, self.loop, lambda: None)
        self._engine.loss_scaler = loss_scale.scaler_of(self.precision)
        self._engine.start(
            module,
            self.world_size,
            self._timeout,
            self._process_group_backend,
            None,
            self.root_device,
            self.num_processes,
        )
        self._buffers.needed = True
        return ScheduledModule(module, self)

    # --------------------------------------------------------------- the loop
    @torch.compiler.disable
    def forward_starts(self, module: nn.Module, traced: bool) -> None:
        """Before the module's forward: with gradients, a training forward (the first after a backward
        starts the batch); without, an evaluation that sees every update. `traced`: torch.compile is tracing
        the wrapper (the module was given to `fabric.setup` compiled): the schedule runs as under compile."""
        schedule = self._engine.schedule
        if schedule is None:
            return
        if traced and not self._engine.compiled_outside:
            self._engine.mark_compiled(module, self.world_size)
            schedule = self._engine.schedule
            assert schedule is not None
        self._evaluating = not torch.is_grad_enabled()
        if self._evaluating:
            schedule.flush()
            self._buffers.before_forward(module, self.control_link)
            return
        if not self._batch_open:
            self._batch_open = True
            self._engine.at_batch_start(self)
            schedule = self._engine.schedule
            assert schedule is not None
        self._profile("phase_started")
        self._buffers.before_forward(module, self.control_link)
        schedule.before_forward()

    @torch.compiler.disable
    def forward_ends(self, module: nn.Module) -> None:
        schedule = self._engine.schedule
        if schedule is None:
            return
        if not self._evaluating:
            schedule.after_forward()
        self._buffers.after_forward(schedule.sync_enabled)
        if not self._evaluating:
            self._profile("forward_done")

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        schedule = self._engine.schedule
        if schedule is None:
            return super().backward(tensor, module, *args, **kwargs)
        self._engine.training_step_returned(tensor)  # the loss: a schedule may judge its choices by it
        self._profile("backward_started")
        super().backward(tensor, module, *args, **kwargs)
        self._profile("backward_done")
        self._batch_open = False
        self._backward_pending = self._backward_pending or schedule.sync_enabled

    def _finish_backward(self, schedule: Schedule) -> None:
        """Before clipping or stepping: every collective of the step was issued on every rank."""
        if self._backward_pending:
            self._backward_pending = False
            schedule.finish_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        schedule = self._engine.schedule
        if schedule is None:
            return super().optimizer_step(optimizer, **kwargs)
        self._finish_backward(schedule)
        try:
            with loss_scale.answered_by(self._engine.loss_scaler, schedule.unscale_gradients):
                output = schedule.optimizer_step(optimizer, lambda: self.precision.optimizer_step(optimizer, **kwargs))
        finally:
            self._engine.iteration_done()
            self._batch_open = False
            self.loop.global_step += 1
        return output

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
        if schedule is None:
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
        if schedule is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._unscale(schedule, optimizer)
        schedule.clip_gradients(optimizer, float(clip_val), "value")

    def _unscale(self, schedule: Schedule, optimizer: Optimizer) -> None:
        """fp16's scaler unscales before clipping (the schedule answers where it holds the gradients)."""
        self._finish_backward(schedule)
        with loss_scale.answered_by(self._engine.loss_scaler, schedule.unscale_gradients):
            self.precision.unscale_gradients(optimizer)

    def _profile(self, event: str) -> None:
        if self._engine.profiler is not None:
            getattr(self._engine.profiler, event)(self)

    # ------------------------------------------------------------ checkpoints
    def _flush(self) -> None:
        if self._engine.schedule is not None:
            self._engine.schedule.flush()

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
        return owner.optimizer_state(optimizer, saved) if owner is not None else saved

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
            saved[LOOP_STEPS] = self.loop.global_step  # where step-driven phases are (top-k's density warm-up)
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
            checkpoint = {KEY: saved}
            warn_if_saved_after_failure(checkpoint)
            restored = Restored(checkpoint, self.schedule_class.name, self.global_rank, self.world_size, path)
            assert self._module is not None
            self._engine.restore(restored, self._module, self.world_size)
            self._batch_open = self._backward_pending = False
        return remaining

    @override
    def teardown(self) -> None:
        log.debug(f"{type(self).__name__}: tearing down schedule and links")
        if self._engine.schedule is not None:
            self._engine.schedule.drain()
        self._engine.stop(destroy_links=True)
        self._module = None
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
    """`fabric.no_backward_sync(model)`: accumulation micro-batches keep their gradients local."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._engine.no_sync() if enabled else nullcontext()
