"""What commsched refuses, each with the message a user needs: checked as early as Lightning allows."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator

from commsched.errors import CommSchedConfigError, bad_value

_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def refuse_before_launch(strategy: Any, grads_complete_after_closure: bool, name: str) -> None:
    """In the Trainer constructor, before any worker process exists."""
    if strategy._layer_sync is not None and isinstance(strategy.accelerator, CPUAccelerator):
        raise CommSchedConfigError(
            "commsched: Trainer(sync_batchnorm=True) is not supported on CPU (SyncBatchNorm needs GPUs). "
            "Use sync_batchnorm=False; BatchNorm buffers are then broadcast from rank 0 as under DDP."
        )
    if getattr(strategy.precision_plugin, "scaler", None) is not None and not grads_complete_after_closure:
        raise CommSchedConfigError(
            f"commsched: precision with a GradScaler (fp16 '16-mixed') is not supported by strategy='{name}': "
            "gradients are sharded when the scaler would unscale them. Use precision='bf16-mixed' or strategy='wfbp'."
        )


def refuse_manual_optimization(module: Any, name: str) -> None:
    if not module.automatic_optimization:
        raise CommSchedConfigError(
            f"commsched: strategy='{name}' supports automatic optimization only "
            "(LightningModule.automatic_optimization=True); manual optimization (several optimizers, "
            "GANs) is not supported yet. Use strategy='ddp' for this module."
        )


def refuse_optimizers(optimizers: list[Any], name: str) -> None:
    if len(optimizers) != 1:
        raise CommSchedConfigError(
            f"commsched: strategy='{name}' supports exactly one optimizer; configure_optimizers returned {len(optimizers)}."
        )
    if isinstance(optimizers[0], _CLOSURE_OPTIMIZERS):
        raise CommSchedConfigError(
            f"commsched: optimizer {type(optimizers[0]).__name__} re-evaluates the closure inside step() and "
            f"cannot be used with strategy='{name}'; allowed: torch.optim optimizers "
            "that step once per closure (SGD, Adam, AdamW, RMSprop, Adagrad, ...)."
        )


def refuse_compression(compression: Any, schedule: Any) -> None:
    """Sparse exchanges only where the schedule builds them (`Schedule.compresses`), refused at construction."""
    if compression.hierarchical and not schedule.compresses:
        raise bad_value("compression.hierarchical", compression.hierarchical, f"None or False with schedule {schedule.name}: "
                        "the two-level exchange runs on wfbp")
    if compression.method != "none" and not schedule.compresses:
        raise bad_value("compression.method", compression.method,
                        f"none with schedule {schedule.name}: sparse exchanges run on wfbp (strategy=\"topk\" is wfbp "
                        "with MSTopK). DeAR splits a bucket's all-reduce into a reduce-scatter and an all-gather it "
                        "defers; a flat sparse exchange is one all-gather, with nothing to defer. DeFT's generations "
                        "sum dense buffers over iterations")
