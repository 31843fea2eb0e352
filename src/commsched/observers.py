"""Exact under every callback: which hooks of user code could see what a schedule has not applied
yet, and the callback that brings everything up to date before they run.

DeAR applies step t's update during the forward of step t+1, and reduces gradients to shards in
backward. Lightning calls callbacks and LightningModule hooks in between. The rule:

- every epoch-level or rare hook (epoch start and end, validation/test/predict start and the
  zero_grad before validation, checkpoints, end of training) is preceded by a flush: cheap, once
  per epoch;
- if any callback or the module overrides a per-step hook that can read weights
  (`on_train_batch_end`, `on_train_batch_start`, the batch-transfer hooks), the pending update is
  applied at the end of every step, before those hooks: the all-gathers no longer overlap the
  next forward (the reduce-scatters still overlap backward);
- if any overrides a hook that reads gradients after backward (`on_after_backward`,
  `on_before_optimizer_step`, `configure_gradient_clipping`), gradients are made whole at the end
  of backward, as DDP does: no forward overlap either.

Lightning's own callbacks that read neither (progress bars, summaries, monitors, checkpointing,
which flushes by itself) are trusted; code marked with `reads_no_weights` is trusted too.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import lightning.pytorch as pl
from lightning.pytorch import callbacks as cb
from lightning.pytorch.utilities import rank_zero_info

from commsched.schedules import Observed, Schedule

Hookable = TypeVar("Hookable")

STEP_WEIGHT_HOOKS = {
    "callback": ("on_train_batch_start", "on_train_batch_end"),
    "module": ("on_train_batch_start", "on_train_batch_end", "on_before_batch_transfer",
               "transfer_batch_to_device", "on_after_batch_transfer"),
}
GRADIENT_HOOKS = {
    "callback": ("on_after_backward", "on_before_optimizer_step"),
    "module": ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"),
}
TRUSTED: tuple[type, ...] = (
    cb.ProgressBar, cb.TQDMProgressBar, cb.RichProgressBar, cb.ModelSummary, cb.RichModelSummary,
    cb.LearningRateMonitor, cb.Timer, cb.EarlyStopping, cb.Checkpoint, cb.ModelCheckpoint, cb.OnExceptionCheckpoint,
    cb.ThroughputMonitor, cb.DeviceStatsMonitor, cb.GradientAccumulationScheduler, cb.SpikeDetection,
    cb.BatchSizeFinder, cb.LearningRateFinder, cb.BasePredictionWriter,
)
_MARK = "commsched_reads_no_weights"


def reads_no_weights(target: Hookable) -> Hookable:
    """Mark a hook (or every hook of a callback class) as reading neither weights nor gradients, so a
    schedule keeps its overlap: ``@commsched.reads_no_weights def on_train_batch_end(...): self.log(...)``."""
    setattr(target, _MARK, True)
    return target


def _overrides(obj: Any, hook: str, base: type) -> bool:
    """Whether `obj` runs code of its own (not trusted, not marked) at `hook`."""
    if hook in vars(obj):  # set on the instance, e.g. LambdaCallback
        return not getattr(vars(obj)[hook], _MARK, False)
    owner = next((k for k in type(obj).__mro__ if hook in vars(k)), None)
    if owner is None or owner in base.__mro__ or owner in TRUSTED or _MARK in vars(owner):
        return False
    return not getattr(vars(owner)[hook], _MARK, False)


def find_observers(callbacks: list[pl.Callback], module: pl.LightningModule) -> tuple[Observed, list[str]]:
    """What the user's callbacks and module observe, and who (for the log)."""
    who: dict[str, list[str]] = {"weights": [], "gradients": []}
    owners = [(c, type(c).__name__, "callback", pl.Callback) for c in callbacks if not isinstance(c, FlushBeforeObservers)]
    owners.append((module, type(module).__name__, "module", pl.LightningModule))
    for obj, label, kind, base in owners:
        for what, hooks in (("weights", STEP_WEIGHT_HOOKS[kind]), ("gradients", GRADIENT_HOOKS[kind])):
            who[what] += [f"{label}.{hook}" for hook in hooks if _overrides(obj, hook, base)]
    observed = Observed(gradients=bool(who["gradients"]), weights_every_step=bool(who["weights"]))
    return observed, who["weights"] + who["gradients"]


def explain(schedule: type[Schedule], observed: Observed, who: list[str]) -> None:
    """Say once what the observers cost a schedule that applies late."""
    if not schedule.applies_late:
        return
    if observed.gradients:
        rank_zero_info(f"commsched {schedule.name}: gradients are read after backward by {', '.join(who)}: they are made "
                       "whole at the end of backward, as DDP does (no overlap with the next forward).")
    elif observed.weights_every_step:
        rank_zero_info(f"commsched {schedule.name}: weights are read between steps by {', '.join(who)}: updates are "
                       "applied at the end of every step (no overlap with the next forward). Mark hooks that read "
                       "neither with @commsched.reads_no_weights to keep it.")


class FlushBeforeObservers(pl.Callback):
    """First in `trainer.callbacks` (the strategy puts it there): runs before every other callback
    and the module's hook, and applies what is pending where someone could look."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self.every_step = False

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        if self.every_step:
            self._flush()

    def _always(self, *args: Any, **kwargs: Any) -> None:
        self._flush()

    on_train_epoch_start = on_train_epoch_end = _always
    on_validation_start = on_test_start = on_predict_start = _always
    on_train_end = on_fit_end = _always

    @staticmethod
    def install(trainer: "pl.Trainer", callback: Optional["FlushBeforeObservers"]) -> None:
        """Put `callback` first (None: remove it). Validation inside fit starts with the module's
        `on_validation_model_zero_grad`, before any callback hook: the update must land before that
        zero_grad, as under DDP, so the module's hook is wrapped too (on the instance, undone here)."""
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, FlushBeforeObservers)]
        module = trainer.lightning_module
        module.__dict__.pop("on_validation_model_zero_grad", None)
        if callback is None:
            return
        trainer.callbacks.insert(0, callback)
        original = module.on_validation_model_zero_grad

        def flush_then_zero_grad() -> None:
            callback._flush()
            original()

        module.on_validation_model_zero_grad = flush_then_zero_grad
