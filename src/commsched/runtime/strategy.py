"""The Lightning strategy: lifecycle, flush points and checkpoint glue around a `Schedule`.

`CommSchedStrategy` subclasses Lightning's `DDPStrategy` for everything DDP already does right
(launcher, ranks, process group, distributed sampler, `sync_dist` logging) but never builds a
`DistributedDataParallel`: `self.model` stays the LightningModule and the schedule installs its
own hooks. The strategy knows *when* things happen in Lightning's loop; the schedule (chosen by name
from `commsched.schedules.SCHEDULES`) knows *what* to communicate. Customisation comes in as options
objects (`commsched.options`), the same ones `commsched-train` validates."""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import contextmanager
from datetime import timedelta
from functools import partial, partialmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Generator, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from commsched import loss_scale, rank_parts, run_files, state
from commsched.comm import peers
from commsched.errors import CommSchedConfigError, PeerFailureError
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
from commsched.runtime import observers, refusals, run_summary
from commsched.runtime.arguments import checked_arguments, refuse_unknown_arguments
from commsched.runtime.buffer_sync import BufferSync
from commsched.runtime.engine import Engine
from commsched.runtime.interrupt import StoppedBySignal
from commsched.runtime.lr_follow import FollowOptimizerSteps
from commsched.runtime.manual_optimization import (
    StepMarks,
    every_optimizer_trainable,
    refuse_by_hand,
    without_delays,
)
from commsched.runtime.run_reports import RunReports
from commsched.say import say, say_from_this_rank
from commsched.schedules import Schedule

log = logging.getLogger(__name__)


class CommSchedStrategy(RunReports, DDPStrategy):
    """Data-parallel training with a communication schedule (`schedule=` one of `SCHEDULES`)."""

    strategy_name = "commsched"
    default_schedule: ClassVar[str] = "dear"
    says_resume_hint: ClassVar[bool] = True
    """Its closing summary says how to continue from the last checkpoint, so `StopAndSave` does not."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "CommSchedStrategy":
        """A misspelt argument is refused with the closest one this class takes, not with Python's bare TypeError."""
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
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        """Every argument has a default (Lightning's registry builds strategies without any).

        Args:
            schedule: the communication schedule (default: this class's), one of ``commsched.SCHEDULES``.
            fusion: a fusion policy name or a `FusionOptions` (which gradients share a bucket); "auto":
                planned from the run's first steps and kept only if measured faster than fixed buckets.
            bucket_cap_mb: shorthand for ``FusionOptions.bucket_cap_mb`` (as on Lightning's `DDPStrategy`);
                given with the default fusion, fixed buckets of that size.
            tuning: `TuningOptions` for ``fusion="bayes"``.
            profile: `ProfileOptions`: steps to profile and where the trace goes (None: nothing profiled).
            links: `LinkOptions`: backend and network interface of each link.
            deft: `DeFTOptions` for ``schedule="deft"``.
            preserver: `PreserverOptions` for ``schedule="deft"``: the guard of delayed plans, on unless
                ``PreserverOptions(enabled=False)``; a `commsched.Preserver` among the callbacks replaces it.
            compression: a method name ("auto", "topk", "sampled", "mstopk", "none") or `CompressionOptions`: sparse
                exchanges of each bucket (schedules that support them: wfbp).
            streams: `StreamOptions`: concurrent collective streams (process groups) carrying each bucket's
                units, a fixed count or searched on the run's own steps (schedules: wfbp, dear); ``"auto"``
                for ``StreamOptions(count="auto")``; None: one stream.
            dear: `DeAROptions` for ``schedule="dear"``: whether WFBP runs the iterations when measured faster.
            schedule_options: a plugin schedule's own options, an instance of its ``options_class`` (dear and
                deft take theirs as ``dear=`` and ``deft=``).
            comm_dtype: what gradients travel as: "fp32" (the default, equal to DDP), or "bf16" / "fp16", cast
                for every collective of gradients (half the bytes) and averaged as DDP's compress hooks do.
            ddp_comm_hook: a DDP communication hook, as given to Lightning's `DDPStrategy`: torch's
                ``bf16_compress_hook``, ``fp16_compress_hook`` and ``allreduce_hook`` are read as the ``comm_dtype``
                they send (every schedule); any other (``powerSGD_hook``, ``batched_powerSGD_hook``, your own) runs
                on each whole bucket, on schedules that all-reduce whole buckets (wfbp), its state in checkpoints.
            ddp_comm_state: the hook's state (e.g. ``PowerSGDState``); None: the primary link's process group.
            ddp_comm_wrapper: a wrapper applied to the hook (e.g. torch's ``fp16_compress_wrapper``).
            broadcast_buffers: broadcast module buffers from rank 0 before forward, as DDP does.
            trace_collectives: record every collective this rank issues (``strategy.collective_trace``).
            timeout: process-group timeout; a dead or hung peer ends the run with `PeerFailureError` after it.
        """
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
        self.schedule_class: type[Schedule] = configured.schedule_class
        self.options = configured.options
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=configured.timeout,
            start_method=configured.start_method,  # type: ignore[arg-type]
        )
        if configured.hook_read is not None:
            say(f"commsched: {configured.hook_read}")
        self._engine = Engine(self.schedule_class, self.options, configured.trace_collectives)
        self._buffers = BufferSync(configured.broadcast_buffers)
        self._flush_points = observers.FlushPoints(self._flush)
        self._lr_follow: Optional[FollowOptimizerSteps] = None
        self._restored: Optional[state.Restored] = None
        self._failed = False
        self._failure_state: Optional[str] = None
        self._clock = run_summary.StepClock()
        self._by_hand = StepMarks()
        self._files_before = 0
        self.run_dir: Optional[Path] = None
        """This fit's folder for the files commsched writes (`commsched.run_files.run_folder`; None: the run has
        none)."""
        self.run_dir_resolved = False

    @property
    def loop(self) -> "pl.Trainer":
        """What runs the training loop, as the engine, the planners and the profiler read it (Fabric's
        strategies hand them a view of the same shape)."""
        return self.lightning_module.trainer

    def request_replan(self) -> None:
        """Decide the fusion plan (and DeFT's plan) again from the next iteration boundary on (all ranks must ask
        together)."""
        self._engine.request_replan()

    @override
    def _configure_launcher(self) -> None:
        refusals.refuse_before_launch(self)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # A failed earlier run on this strategy is over: this one's barriers (Lightning's first comes
        # before `setup`) and checkpoints are those of a running fit.
        self._failed, self._failure_state = False, None
        super().setup_environment()

    @override
    def configure_ddp(self) -> None:
        """Links, buckets and hooks instead of a DistributedDataParallel wrapper."""
        module = self.lightning_module
        self._engine.start(
            module,
            self.world_size,
            self._timeout,
            self._process_group_backend,
            self._restored,
            self.root_device,
            self.num_processes,
            state_later=not module.automatic_optimization,  # several optimizers may cut the buckets at setup
        )
        self._restored = None
        self._buffers.needed = True
        self._failed = False

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.run_dir, self.run_dir_resolved = (
            run_files.run_folder(trainer),
            True,
        )  # collective: every rank, before anything writes
        peers.learn()  # collective: a failed collective can then name the rank that is gone
        self._clock, self._files_before = run_summary.StepClock(), len(run_files.WRITTEN)
        log.debug(
            f"{self.__class__.__name__}: files of this run go to "
            f"{self.run_dir or 'no folder (no logger, no checkpoints)'}"
        )
        by_hand = not trainer.lightning_module.automatic_optimization
        options = without_delays(self.options) if by_hand else self.options
        if by_hand and options is not self.options and self.schedule_class.name == "deft":
            say(
                "commsched deft: under manual optimization, plans without delay (a delayed plan skips optimizer "
                "steps, which training_step takes itself); DeFT still chooses between WFBP, DeAR and its plan"
            )
        self._engine.settings = self.schedule_class.settings_for(options, trainer, self._advance_schedulers)
        self._engine.loss_scaler = loss_scale.scaler_of(self.precision_plugin)
        self._by_hand = StepMarks()
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if self.schedule_class.skips_steps and not by_hand:
                self._lr_follow = FollowOptimizerSteps(
                    trainer.lightning_module, self.lr_scheduler_configs, self._steps_this_iteration
                )
            name = self.schedule_class.name
            if by_hand and len(self.optimizers) > 1:
                self._engine.step_whole_for_good(
                    f"this module steps {len(self.optimizers)} optimizers by hand; each optimizer's update would "
                    "land bucket by bucket in the next forward after the next backward started"
                )
            steps_whole = self._engine.steps_whole  # as the running schedule steps
            refusals.refuse_optimizer_setup(self.optimizers, name, steps_whole, by_hand)
            if by_hand:
                refuse_by_hand(self.options, self.optimizers, name)
            if by_hand and len(self.optimizers) > 1:
                self._engine.keep_apart(self.optimizers, trainer.lightning_module, self.world_size)
            self._engine.load_state_later()
            self.schedule_class.refuse_optimizers(options, self.optimizers)
            refusals.refuse_under_scaler(self._engine.loss_scaler, self.optimizers, name, steps_whole, self.options)
            # Lightning clips through the precision plugin; the schedule knows where the averaged gradients are.
            self.precision_plugin.clip_gradients = self._clip_gradients  # type: ignore[method-assign]
            observers.FlushPoints.install(trainer, self._flush_points)

    # --------------------------------------------------------------- training
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._engine.schedule is not None:
            self._by_hand.stepped_this_batch = False
            with every_optimizer_trainable(self.optimizers if self._stepped_by_hand else (), self._engine.bucketed):
                self._engine.at_batch_start(self)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches: gradients stay local, nothing is communicated."""
        with self._engine.no_sync():
            yield None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        schedule = self._engine.schedule
        if schedule is None:
            return super().training_step(*args, **kwargs)
        self._profile("phase_started")
        self._buffers.before_forward(self.lightning_module, self.control_link)
        schedule.before_forward()
        self._by_hand.forward_open = True
        output = super().training_step(*args, **kwargs)
        self._forward_ends(schedule, output)  # by hand: at the first backward, or here if none ran
        return output

    def _forward_ends(self, schedule: Schedule, loss: Any) -> None:
        if not self._by_hand.forward_open:
            return
        self._by_hand.forward_open = False
        self._engine.training_step_returned(loss)
        schedule.after_forward()
        # By hand, Lightning's DDP turns its wrapper's sync off around each training_step: buffers go out from
        # rank 0 before the fit's first forward only, and each rank keeps its own statistics from then on.
        self._buffers.after_forward(schedule.sync_enabled and not self._stepped_by_hand)
        self._profile("forward_done")

    @property
    def _stepped_by_hand(self) -> bool:
        module = self.lightning_module
        return module is not None and not module.automatic_optimization

    def _evaluation_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        if self._engine.schedule is not None:
            self._buffers.before_forward(self.lightning_module, self.control_link)
        output = getattr(super(), step)(*args, **kwargs)
        if self._engine.schedule is not None:
            self._buffers.after_forward(self._engine.schedule.sync_enabled)
        return output

    validation_step = override(partialmethod(_evaluation_step, "validation_step"))
    test_step = override(partialmethod(_evaluation_step, "test_step"))
    predict_step = override(partialmethod(_evaluation_step, "predict_step"))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        schedule = self._engine.schedule
        if schedule is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._stepped_by_hand:
            return self._step_by_hand(schedule, optimizer, closure, model, **kwargs)

        def closure_then_reduce() -> Any:
            output = closure()
            schedule.finish_backward()
            return output

        # Strategy.optimizer_step, not DDPStrategy's: DDP's only adds post-localSGD model averaging.
        try:
            with loss_scale.answered_by(self._engine.loss_scaler, schedule.unscale_gradients):
                output = schedule.optimizer_step(
                    optimizer, partial(Strategy.optimizer_step, self, optimizer, closure_then_reduce, model, **kwargs)
                )
        finally:
            self._engine.iteration_done()
        self._clock.stepped(self.exposed_comm_seconds, sum(self.wire_bytes.values()))
        return output

    def _step_by_hand(
        self,
        schedule: Schedule,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", nn.Module]],
        **kwargs: Any,
    ) -> Any:
        """`optimizer.step()` in the user's `training_step`: its backward (before, or in `closure`) finished
        its collectives when it returned; with no synchronised one (none, or one kept local by `no_sync`), the
        optimizer steps on `.grad` as it is, as under DDP. The closure runs inside the step, as Lightning runs
        it: after torch's step pre-hooks, under the sync setting the step was called in."""
        by_closure = closure is not do_nothing_closure
        run_step = partial(Strategy.optimizer_step, self, optimizer, closure, model, **kwargs)
        if not (self._by_hand.backward_pending or (by_closure and schedule.sync_enabled)):
            schedule.flush()
            self._engine.iteration_done()
            return run_step()
        if by_closure and not schedule.steps_whole:
            run_step = partial(
                Strategy.optimizer_step, self, optimizer, self._with_backward(schedule, closure), model, **kwargs
            )
        try:
            with loss_scale.answered_by(self._engine.loss_scaler, schedule.unscale_gradients):
                output = schedule.optimizer_step(optimizer, run_step)
        finally:
            self._by_hand.backward_pending = False
            self._engine.iteration_done()
        if not self._by_hand.stepped_this_batch:
            self._by_hand.stepped_this_batch = True
            self._clock.stepped(self.exposed_comm_seconds, sum(self.wire_bytes.values()))
        return output

    def _with_backward(self, schedule: Schedule, closure: Callable[[], Any]) -> Callable[[], Any]:
        """`closure`, then a check that a synchronised backward ran (the schedule steps where it put the
        gradients; a closure that computed none leaves it nothing to step)."""

        def closure_then_check() -> Any:
            output = closure()
            if not self._by_hand.backward_pending:
                raise CommSchedConfigError(
                    f"commsched: optimizer.step(closure=...) under strategy '{schedule.name}' whose closure ran no "
                    "synchronised manual_backward; the step runs where that backward leaves the gradients. Call "
                    "manual_backward in the closure, step without a closure, or use strategy='wfbp'"
                )
            return output

        return closure_then_check

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        schedule = self._engine.schedule
        if schedule is not None and self._stepped_by_hand:
            self._forward_ends(schedule, closure_loss)
            sparse = self.options.compression.method != "none"
            if self._by_hand.backward_pending and (not schedule.steps_whole or sparse):
                where = "sparse exchange" if sparse else f"strategy '{schedule.name}'"
                raise CommSchedConfigError(
                    f"commsched: another manual_backward after a synchronised one, before optimizer.step(), under "
                    f"{where}: the first's gradients are {'exchanged sparsely' if sparse else 'still on the network'}"
                    " and cannot be added to. Keep the gradients of all but the last backward local "
                    "(`with optimizer.toggle_model(sync_grad=False):`, as DDP needs for speed too), or use "
                    "strategy='wfbp' without compression"
                )
            profiling = self._engine.profiler is not None and self._engine.profiler.active  # times every bucket
            several = len(self.optimizers) > 1  # a GAN's half: the other half's buckets send nothing
            schedule.capture.agree_on_idle(
                schedule.sync_enabled and several and schedule.skips_idle_buckets() and not profiling
            )
        self._profile("backward_started")

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        schedule = self._engine.schedule
        if schedule is not None and self._stepped_by_hand and schedule.sync_enabled:
            schedule.finish_backward()  # as DDP: every collective of this backward issued when it returns
            self._by_hand.backward_pending = True
        self._profile("backward_done")

    def _profile(self, event: str) -> None:
        if self._engine.profiler is not None:
            getattr(self._engine.profiler, event)(self)

    def _clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self._engine.schedule is not None:
            self._engine.schedule.clip_gradients(
                optimizer, float(clip_val), GradClipAlgorithmType(gradient_clip_algorithm).value
            )

    def _steps_this_iteration(self) -> int:
        return self._engine.schedule.steps_this_iteration if self._engine.schedule is not None else 1

    def _advance_schedulers(self) -> None:
        if self._lr_follow is not None:
            self._lr_follow.advance()

    # ------------------------------------------------------------ flush points
    def _flush(self) -> None:
        if self._engine.schedule is None:
            return
        if self._run_failed():  # e.g. OnExceptionCheckpoint saving: the schedule completes or takes back its step
            self._note_failure()
        else:
            self._engine.schedule.flush()

    def _drain(self) -> None:
        if self._engine.schedule is not None and not self._failed:
            self._engine.schedule.drain()

    on_validation_start = on_test_start = on_predict_start = override(_flush)

    @override
    def on_train_end(self) -> None:
        if not self._failed:
            self._engine.finish_profile(self)  # a run shorter than its profile: report what there is
        self._flush()
        if (
            not self._failed
            and self._engine.owner is not None
            and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        ):
            self._say_summary()

    def _say_summary(self) -> None:
        """The fit's closing lines (rank 0 says them; every rank gathers the schedule's part)."""
        assert self._engine.owner is not None
        decided = self._engine.summary()  # may write files (an unfinished search's trials)
        written = run_files.WRITTEN[self._files_before :]
        lines = run_summary.closing_lines(self, self.lightning_module.trainer, self._clock, decided, written)
        say("\n".join(lines))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._flush()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        self._flush()
        saved, owner = super().optimizer_state(optimizer), self._engine.owner or self._engine.finished  # after fit too
        return (
            owner.optimizer_state(optimizer, saved)
            if owner and dist.is_initialized() and not self._run_failed()
            else saved
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Called on every rank: each rank writes its own communication state beside the checkpoint, rank 0
        the checkpoint (also after `fit` returned, from the schedule that ran it, unless the fit failed)."""
        if self._run_failed():
            # the process group may be broken: gathering the ranks' state would wait for the timeout
            self._note_failure()
            what = "as said above" if self._failure_state else "those of the last step taken, whole"
            say_from_this_rank(
                f"commsched: this checkpoint, saved after the run failed, holds this rank's weights ({what}) "
                "and no communication state"
            )
            if self._failure_state is not None:  # the step counters count a step these weights do not hold
                checkpoint[state.AFTER_FAILURE_KEY] = self._failure_state
        elif self._engine.schedule is not None or (self._engine.finished is not None and dist.is_initialized()):
            self._flush()  # nothing to flush once the fit is over
            checkpoint[state.KEY] = self._engine.checkpoint_state(self.world_size, filepath)
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        except BaseException:
            rank_parts.discard(filepath, checkpoint.get(state.KEY))
            raise
        if self.is_global_zero and state.KEY in checkpoint:  # the checkpoint names its parts: older saves' go
            rank_parts.keep_only(filepath, checkpoint[state.KEY].get(rank_parts.PARTS_KEY))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """With each rank's communication state beside it (ModelCheckpoint keeping its best k)."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            rank_parts.remove(filepath)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Not after a failure (Lightning's save_checkpoint ends with one): the group may be broken, and a
        barrier on it would fail or wait for the timeout instead of letting the run end with its error."""
        if not self._run_failed():
            super().barrier(name)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state.warn_if_saved_after_failure(checkpoint)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            return checkpoint  # validate, test, predict: the weights only, no communication to resume
        # applied once the buckets exist (configure_ddp); refused here if it cannot be resumed at this world size
        self._restored = state.Restored(
            checkpoint, self.schedule_class.name, self.global_rank, self.world_size, checkpoint_path
        )
        return checkpoint

    def _run_failed(self) -> bool:
        """The run has failed, also while callbacks' `on_exception` run (OnExceptionCheckpoint saves
        there), which Lightning calls before the strategy's."""
        if self._failed:
            return True
        exception = sys.exc_info()[1]
        return (
            exception is not None
            and not isinstance(exception, StoppedBySignal)
            and self.lightning_module is not None
            and self.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED
        )

    def _note_failure(self, exception: Optional[BaseException] = None) -> None:
        """Say once, from this rank, what its model holds when that is not simply one step's weights
        (not after a second Ctrl-C: the user asked to stop without saving)."""
        running = self._engine.schedule
        if isinstance(exception if exception is not None else sys.exc_info()[1], KeyboardInterrupt):
            return
        if self._failure_state is None and running is not None:
            self._failure_state = running.after_failure()
            if self._failure_state is not None:
                say_from_this_rank(f"commsched: the run failed on rank {self.global_rank}: {self._failure_state}")

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Every rank stops by signal at the same step, everything applied and saved: not a failure.
        self._failed = not isinstance(exception, StoppedBySignal)
        if self._failed:
            gone = (
                None if isinstance(exception, KeyboardInterrupt) else peers.describe_gone()
            )  # Ctrl-C: the user stops every rank
            if gone is not None and gone not in str(exception):  # e.g. Lightning's own collective failed first
                say_from_this_rank(
                    f"commsched: {gone}: the run stops on rank {self.global_rank} ({type(exception).__name__})"
                )
            self._note_failure(exception)
        super().on_exception(exception)
        if isinstance(exception, PeerFailureError) and self.launcher is not None:
            # Lightning leaves worker processes alone on ordinary errors; a hung peer would then
            # outlive the run. The run is over: end the workers this process launched (none on ranks > 0).
            self.launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        log.debug(f"{self.__class__.__name__}: tearing down schedule and links")
        # Delayed updates land here: after on_train_end, where ModelCheckpoint saves the last
        # checkpoint with the delayed state (resuming from it is exact), before the run returns.
        self._drain()
        self._engine.stop(destroy_links=not self._failed)
        if self._lr_follow is not None:
            self._lr_follow.remove()
            self._lr_follow = None
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            observers.FlushPoints.install(self.lightning_module.trainer, None)
        self.precision_plugin.__dict__.pop("clip_gradients", None)
        super().teardown()
