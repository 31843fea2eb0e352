"""What commsched refuses, each with the message a user needs: checked as early as Lightning allows."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator

from commsched.errors import CommSchedConfigError
from commsched.reducers.hook_state import powersgd_state

_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def refuse_before_launch(strategy: Any) -> None:
    """In the Trainer constructor, before any worker process exists."""
    if strategy._layer_sync is not None and isinstance(strategy.accelerator, CPUAccelerator):
        raise CommSchedConfigError(
            "commsched: Trainer(sync_batchnorm=True) is not supported on CPU (SyncBatchNorm needs GPUs). "
            "Use sync_batchnorm=False; BatchNorm buffers are then broadcast from rank 0 as under DDP."
        )


def refuse_optimizer_setup(optimizers: list[Any], name: str, steps_whole: bool = True, by_hand: bool = False) -> None:
    """`by_hand`: the user steps the optimizers (manual optimization), so there may be several."""
    if not optimizers or (len(optimizers) > 1 and not by_hand):
        raise CommSchedConfigError(
            f"commsched: strategy='{name}' steps exactly one optimizer under automatic optimization; "
            f"configure_optimizers returned {len(optimizers)}. Several optimizers (a GAN's) are stepped by hand: "
            "set self.automatic_optimization = False in the LightningModule, as Lightning requires for them."
        )
    closure_optimizers = [o for o in optimizers if isinstance(o, _CLOSURE_OPTIMIZERS)]
    if closure_optimizers:
        raise CommSchedConfigError(
            f"commsched: optimizer {type(closure_optimizers[0]).__name__} re-evaluates the closure inside step() and "
            f"cannot be used with strategy='{name}'; allowed: torch.optim optimizers "
            "that step once per closure (SGD, Adam, AdamW, RMSprop, Adagrad, ...)."
        )
    if not steps_whole and any(getattr(o, "parallel_norms", False) for o in optimizers):
        raise CommSchedConfigError(
            f"commsched: LARS(parallel_norms=True) all-reduces its per-layer norms inside step(), which needs every "
            f"rank to hold whole gradients and step at once; strategy='{name}' steps parts of the model at different "
            "times. Use LARS(parallel_norms=False) here, or strategy='wfbp' (or 'topk', or Lightning's 'ddp')."
        )


def refuse_under_scaler(scaler: Any, optimizers: list[Any], name: str, steps_whole: bool, options: Any) -> None:
    """What fp16's GradScaler cannot serve here, once the optimizers exist (before any step)."""
    if scaler is None:
        return
    sparse = options.compression.method != "none"
    fused = [type(o).__name__ for o in optimizers if getattr(o, "_step_supports_amp_scaling", False)]
    if fused and (sparse or not steps_whole):
        why = "its gradients were unscaled before the sparse exchange" if sparse else "its update is applied later"
        raise CommSchedConfigError(
            f"commsched: {fused[0]} unscales inside its own step (fused=True), reading the GradScaler's scale as "
            f"it is during the step; under precision='16-mixed' strategy='{name}' {why}. Use fused=False "
            "(foreach is as fast on most models), or precision='bf16-mixed'."
        )
    hook = getattr(options, "comm_hook", None)
    powersgd = powersgd_state(hook.state) if hook is not None else None
    if powersgd is not None and (powersgd.use_error_feedback or powersgd.warm_start):
        raise CommSchedConfigError(
            "commsched: ddp_comm_hook with a PowerSGDState that keeps error feedback or warm-starts Q, under "
            "precision='16-mixed': one step whose gradients overflow puts inf into that state for good (under "
            "DDP as well). Use precision='bf16-mixed', or PowerSGDState(use_error_feedback=False, warm_start=False)."
        )
    if sparse and options.comm_dtype == "fp16":
        raise CommSchedConfigError(
            "commsched: invalid comm_dtype='fp16' with compression under precision='16-mixed': a sparse exchange "
            "sends unscaled gradients, whose small values fp16 loses; allowed here: comm_dtype='bf16' or 'fp32'."
        )
