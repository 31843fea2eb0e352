"""The Lightning strategies: lifecycle, flush points and checkpoint glue around a `Schedule`.

`CommSchedStrategy` subclasses Lightning's `DDPStrategy` for everything DDP already does right
(launcher, ranks, process group, distributed sampler, `sync_dist` logging) but never builds a
`DistributedDataParallel`: `self.model` stays the LightningModule and the schedule installs its
own hooks. The strategy knows *when* things happen in Lightning's loop; the schedule knows *what*
to communicate. Module buffers (BatchNorm statistics) are broadcast from rank 0 at exactly the
forwards where DDP broadcasts them, so runs match `ddp` bit for bit in intent.
"""

from __future__ import annotations

import signal
from pathlib import Path
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Callable, ClassVar, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

import lightning.pytorch as pl
from commsched import options
from commsched.buckets import BucketPlan, build_plan, verify_same_on_all_ranks
from commsched.errors import CommSchedConfigError, PeerFailureError, bad_value
from commsched.fusion import MODEL_POLICIES, plan_fixed, plan_layers
from commsched.planning import BayesOptions, PlanController, SavedPlan
from commsched.links import CollectiveRecord, Link
from commsched.profile import RunProfiler
from commsched.schedules import DeARSchedule, Schedule, WFBPSchedule

_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


class CommSchedStrategy(DDPStrategy):
    """Data-parallel training with a communication schedule chosen by the subclass."""

    schedule_class: ClassVar[type[Schedule]]

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        fusion: str = "fixed",
        bucket_layers: int = 1,
        plan_profile_steps: int = 5,
        plan_warmup_steps: int = 5,
        bayes_trials: int = 10,
        bayes_warmup_steps: int = 2,
        bayes_trial_steps: int = 10,
        bayes_min_mb: float = 1.0,
        bayes_max_mb: float = 100.0,
        bayes_first_mb: float = 25.0,
        plan_file: Optional[str] = None,
        broadcast_buffers: bool = True,
        trace_collectives: bool = False,
        profile_steps: int = 0,
        profile_dir: Optional[str] = None,
        profile_probe: bool = False,
        timeout: Optional[timedelta] = default_pg_timeout,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        """
        Args:
            bucket_cap_mb: size limit of one bucket for ``fusion="fixed"`` (MB of gradient, any dtype).
            fusion: ``"fixed"`` (buckets up to ``bucket_cap_mb``), ``"layers"`` (``bucket_layers`` layers each),
                ``"mgwfbp"`` (MG-WFBP's exact plan), ``"mgwfbp-greedy"`` (the paper's rule), ``"dear-model"``
                (the plan minimising the modelled DeAR iteration): planned by rank 0 from a profile of the
                ``plan_profile_steps`` steps on ``bucket_cap_mb`` buckets, after ``plan_warmup_steps`` left out
                (a run's first steps are slow while allocator and kernel caches warm up; planning from them
                overstates compute); or ``"bayes"``: the bucket size
                tuned online by Bayesian optimisation, ``bayes_trials`` trials of ``bayes_trial_steps`` timed
                steps after ``bayes_warmup_steps``, sizes in ``bayes_min_mb..bayes_max_mb`` starting at
                ``bayes_first_mb``. The chosen plan is saved to
                ``<default_root_dir>/commsched_plan.json`` and stored in checkpoints (a resumed run keeps it).
            bucket_layers: layers per bucket for ``fusion="layers"``; a layer is a module owning parameters.
            plan_file: a saved plan (``commsched-plan``, or a previous run's ``commsched_plan.json``) to use
                from the first step, skipping profiling and tuning.
            broadcast_buffers: broadcast module buffers from rank 0 before forward, as DDP does.
            trace_collectives: record every collective this rank issues (``strategy.collective_trace``).
            profile_steps: profile the first N training steps (0: off): per-layer and per-bucket times,
                exposed communication, overlap; writes ``profile.json`` and a Chrome ``trace.json`` to
                ``profile_dir`` (default ``<default_root_dir>/commsched_profile``) and logs ``profile/*``.
            profile_probe: also fit the link's alpha-beta costs at the end of profiling (``link`` in the JSON).
            timeout: process-group timeout; a dead or hung peer ends the run with an error after it.
        """
        self._bucket_cap_mb = options.positive_number("bucket_cap_mb", bucket_cap_mb)
        self._fusion = options.fusion_policy(fusion)
        self._bucket_layers = options.positive_int("bucket_layers", bucket_layers)
        self._plan_profile_steps = options.positive_int("plan_profile_steps", plan_profile_steps)
        self._plan_warmup_steps = options.non_negative_int("plan_warmup_steps", plan_warmup_steps)
        bayes = BayesOptions(trials=options.positive_int("bayes_trials", bayes_trials),
                             warmup_steps=options.non_negative_int("bayes_warmup_steps", bayes_warmup_steps),
                             trial_steps=options.positive_int("bayes_trial_steps", bayes_trial_steps),
                             min_mb=options.positive_number("bayes_min_mb", bayes_min_mb),
                             max_mb=options.positive_number("bayes_max_mb", bayes_max_mb),
                             first_mb=options.positive_number("bayes_first_mb", bayes_first_mb))
        if not bayes.min_mb <= bayes.first_mb <= bayes.max_mb:
            raise bad_value("bayes_first_mb", bayes_first_mb, f"a size within bayes_min_mb..bayes_max_mb "
                            f"({bayes.min_mb}..{bayes.max_mb}), with bayes_min_mb < bayes_max_mb")
        self._plan_file = SavedPlan.load(plan_file) if plan_file is not None else None
        self._controller: Optional[PlanController] = None
        if self._fusion in (*MODEL_POLICIES, "bayes") and self._plan_file is None:  # a plan file skips planning
            self._controller = PlanController(self._fusion, self._bucket_cap_mb, bayes)
        self._resumed_plan: Optional[SavedPlan] = None
        self._broadcast_buffers = options.flag("broadcast_buffers", broadcast_buffers)
        self._trace_collectives = options.flag("trace_collectives", trace_collectives)
        self._profile_steps = options.non_negative_int("profile_steps", profile_steps)
        self._profile_dir = Path(profile_dir).expanduser() if profile_dir is not None else None
        self._profile_probe = options.flag("profile_probe", profile_probe)
        self._profiler: Optional[RunProfiler] = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=options.timeout(timeout),
            start_method=options.choice("start_method", start_method, options.START_METHODS),  # type: ignore[arg-type]
        )
        self._schedule: Optional[Schedule] = None
        self._link: Optional[Link] = None  # the schedule's own process group
        self._control = Link(None)  # the default group: setup checks, buffer broadcasts
        self._trace: Optional[list[CollectiveRecord]] = None
        self._trainable: tuple[int, ...] = ()
        self._buffers_need_sync = True
        self._failed = False

    # ------------------------------------------------------------------ public
    @property
    def schedule(self) -> Optional[Schedule]:
        return self._schedule

    @property
    def bucket_plan(self) -> Optional[BucketPlan]:
        return self._schedule.plan if self._schedule is not None else None

    @property
    def exposed_comm_seconds(self) -> float:
        """Total time this rank's training loop waited on communication (not hidden behind compute)."""
        return self._control.clock.seconds + (self._link.clock.seconds if self._link is not None else 0.0)

    @property
    def control_link(self) -> Link:
        """The default group's link: setup checks, buffer broadcasts, plan decisions."""
        return self._control

    @property
    def fusion_plan(self) -> Optional[SavedPlan]:
        """The plan a planner, the tuner, a plan file or a checkpoint decided (None while still deciding)."""
        if self._plan_file is not None:
            return self._plan_file
        return self._controller.decided if self._controller is not None else None

    @property
    def tuning_trials(self) -> list[dict[str, float]]:
        """Bayesian tuning's trials so far: bucket size and median step time of each."""
        return list(self._controller.trials) if self._controller is not None else []

    @property
    def profile(self) -> Optional[dict[str, Any]]:
        """What ``profile_steps`` measured (the content of profile.json), once profiling finished."""
        return self._profiler.result if self._profiler is not None else None

    @property
    def collective_trace(self) -> list[CollectiveRecord]:
        """Collectives issued by this rank during the last fit (needs ``trace_collectives=True``)."""
        return list(self._trace or [])

    # ---------------------------------------------------------- before launch
    def _configure_launcher(self) -> None:
        # Runs in the Trainer constructor, before any worker process exists: refuse here what we can.
        if self._layer_sync is not None and isinstance(self.accelerator, CPUAccelerator):
            raise CommSchedConfigError(
                "commsched: Trainer(sync_batchnorm=True) is not supported on CPU (SyncBatchNorm needs GPUs). "
                "Use sync_batchnorm=False; BatchNorm buffers are then broadcast from rank 0 as under DDP."
            )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not self.schedule_class.grads_complete_after_closure:
            raise CommSchedConfigError(
                f"commsched: precision with a GradScaler (fp16 '16-mixed') is not supported by "
                f"strategy='{self.schedule_class.name}': gradients are sharded when the scaler would unscale "
                "them. Use precision='bf16-mixed' or strategy='wfbp'."
            )
        super()._configure_launcher()

    # ------------------------------------------------------------------ setup
    def configure_ddp(self) -> None:
        """Build buckets and install hooks instead of wrapping the model in DistributedDataParallel."""
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise CommSchedConfigError(
                f"commsched: strategy='{self.schedule_class.name}' supports automatic optimization only "
                "(LightningModule.automatic_optimization=True); manual optimization (several optimizers, "
                "GANs) is not supported yet. Use strategy='ddp' for this module."
            )
        # A process group of our own: Lightning issues blocking collectives on the default group every
        # step (e.g. its SIGTERM broadcast), which would otherwise queue behind DeAR's all-gathers
        # and serialise them with the next forward.
        self._trace = [] if self._trace_collectives else None
        self._link = Link(dist.new_group(timeout=self._timeout), trace=self._trace, lane="link: schedule")
        # Setup checks and DDP-style buffer broadcasts stay on the default group, so they never
        # queue behind the schedule's in-flight collectives either.
        self._control = Link(None, trace=self._trace, lane="link: control")
        if self._controller is not None and self._resumed_plan is not None:
            self._controller.adopt(self._resumed_plan)
        self._build_schedule(module)
        self._control.broadcast_tensors([*module.parameters(), *module.buffers()], src=0, tag="initial-state")
        self._buffers_need_sync = True
        self._failed = False
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        planning = self._controller is not None and self._controller.tuning and self._fusion in MODEL_POLICIES
        if fitting and (self._profile_steps or planning):
            warmup = self._plan_warmup_steps if planning else 1
            steps = max(self._profile_steps, self._plan_profile_steps + warmup if planning else 0)
            self._profiler = RunProfiler(steps, self._profile_dir, self._profile_probe or planning, warmup=warmup)
            self._profiler.start(module, [self._link, self._control])

    def _build_schedule(self, module: nn.Module) -> None:
        assert self._link is not None
        plan = build_plan(module, self.world_size, self._planner())
        verify_same_on_all_ranks(plan, module, self._control)
        self._schedule = self.schedule_class(plan, self._link)
        self._schedule.attach(module)
        self._trainable = _trainable_ids(module)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Rebuild the buckets when the set of trainable parameters changed (e.g. BaseFinetuning
        unfreezing a backbone). Runs after the user's and callbacks' batch-start hooks; every rank
        must make the same change at the same step, which the plan check verifies."""
        if self._profiler is not None:
            self._profiler.on_batch_start(self)
        if self._controller is not None and self._schedule is not None and self._controller.on_batch_start(self):
            self._rebuild()
            self._controller.rebuilt(self)
            return
        module = self.lightning_module
        if self._schedule is None or module is None or _trainable_ids(module) == self._trainable:
            return
        self._rebuild()

    def _rebuild(self) -> None:
        """New buckets at an iteration boundary: apply what is pending, then rebuild with the current planner."""
        assert self._schedule is not None
        sync_enabled = self._schedule.sync_enabled
        self._schedule.flush()
        self._schedule.detach()
        self._build_schedule(self.lightning_module)
        self._schedule.sync_enabled = sync_enabled

    def _planner(self) -> Callable[..., list[list[int]]]:
        if self._plan_file is not None:
            return self._plan_file.planner()
        if self._controller is not None:
            return self._controller.planner()
        if self._fusion == "layers":
            return partial(plan_layers, layers_per_bucket=self._bucket_layers)
        return partial(plan_fixed, cap_bytes=int(self._bucket_cap_mb * 2**20))

    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_optimizers()
            # Lightning clips through the precision plugin; route it to the schedule, which knows where
            # the averaged gradients are (whole in `.grad` for wfbp, sharded for dear).
            self.precision_plugin.clip_gradients = self._clip_gradients  # type: ignore[method-assign]

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise CommSchedConfigError(
                f"commsched: strategy='{self.schedule_class.name}' supports exactly one optimizer; "
                f"configure_optimizers returned {len(self.optimizers)}."
            )
        optimizer = self.optimizers[0]
        if isinstance(optimizer, _CLOSURE_OPTIMIZERS):
            raise CommSchedConfigError(
                f"commsched: optimizer {type(optimizer).__name__} re-evaluates the closure inside step() and "
                f"cannot be used with strategy='{self.schedule_class.name}'; allowed: torch.optim optimizers "
                "that step once per closure (SGD, Adam, AdamW, RMSprop, Adagrad, ...)."
            )

    # --------------------------------------------------------------- training
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches: gradients stay local, nothing is communicated."""
        if self._schedule is None:
            yield None
            return
        self._schedule.sync_enabled = False
        try:
            yield None
        finally:
            self._schedule.sync_enabled = True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._schedule is None:
            return super().training_step(*args, **kwargs)
        if self._profiler is not None:
            self._profiler.phase_started(self)
        self._sync_buffers_before_forward()
        self._schedule.before_forward()
        output = super().training_step(*args, **kwargs)
        self._schedule.after_forward()
        self._note_forward_done()
        if self._profiler is not None:
            self._profiler.forward_done(self)
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_forward(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_forward(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_forward(super().predict_step, *args, **kwargs)

    def _evaluation_forward(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._sync_buffers_before_forward()
        output = step(*args, **kwargs)
        self._note_forward_done()
        return output

    def _sync_buffers_before_forward(self) -> None:
        # DDP broadcasts buffers before a forward iff the previous forward ran with grad and sync.
        if self._schedule is not None and self._broadcast_buffers and self._buffers_need_sync:
            buffers = list(self.lightning_module.buffers())
            if buffers:
                self._control.broadcast_tensors(buffers, src=0, tag="buffers")

    def _note_forward_done(self) -> None:
        if self._schedule is not None:
            self._buffers_need_sync = torch.is_grad_enabled() and self._schedule.sync_enabled

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        schedule = self._schedule
        if schedule is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce() -> Any:
            output = closure()
            schedule.finish_backward()
            return output

        # Strategy.optimizer_step, not DDPStrategy's: DDP's only adds post-localSGD model averaging.
        run = partial(Strategy.optimizer_step, self, optimizer, closure_then_reduce, model, **kwargs)
        return schedule.optimizer_step(optimizer, run)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._profiler is not None:
            self._profiler.backward_started(self)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._profiler is not None:
            self._profiler.backward_done(self)

    def _clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0 or self._schedule is None:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._schedule.clip_grad_value(optimizer, float(clip_val))
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self._schedule.clip_grad_norm(optimizer, float(clip_val))

    # ------------------------------------------------------------ flush points
    def _flush(self) -> None:
        if self._schedule is not None and not self._failed:
            self._schedule.flush()

    def on_validation_start(self) -> None:
        self._flush()

    def on_test_start(self) -> None:
        self._flush()

    def on_predict_start(self) -> None:
        self._flush()

    def on_train_end(self) -> None:
        if self._profiler is not None and self._profiler.active and not self._failed:
            self._profiler.finish(self)  # the run was shorter than profile_steps: report what there is
        self._flush()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._flush()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        self._flush()
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        plan = self.fusion_plan
        if plan is not None:
            checkpoint["commsched_fusion_plan"] = {"version": 1, **vars(plan)}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get("commsched_fusion_plan")
        if saved is not None and self._controller is not None:
            self._resumed_plan = SavedPlan.from_dict(saved)  # applied when the buckets are built: no re-tuning
        return checkpoint

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)
        if isinstance(exception, PeerFailureError) and self.launcher is not None:
            # Lightning leaves worker processes alone on ordinary errors; a hung peer would then
            # outlive the run. The run is over: end the workers this process launched (none on ranks > 0).
            self.launcher.kill(signal.SIGKILL)

    def teardown(self) -> None:
        if self._schedule is not None:
            self._flush()
            self._schedule.detach()
            self._schedule = None
        if self._link is not None and self._link.group is not None and not self._failed:
            dist.destroy_process_group(self._link.group)
            self._link.group = None
        self.precision_plugin.__dict__.pop("clip_gradients", None)
        super().teardown()


def _trainable_ids(module: nn.Module) -> tuple[int, ...]:
    return tuple(id(p) for p in module.parameters() if p.requires_grad)


class WFBPStrategy(CommSchedStrategy):
    """Bucketed all-reduce launched during backward as buckets fill (DDP's schedule, in the open)."""

    schedule_class = WFBPSchedule


class DeARStrategy(CommSchedStrategy):
    """DeAR: reduce-scatter during backward, all-gather overlapped with the next forward."""

    schedule_class = DeARSchedule
