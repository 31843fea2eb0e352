"""Flush points at the loop's rare hooks, where a schedule that applies updates late brings every
parameter up to date before user code runs.

Exactness per step is `commsched.schedules.pending_tensors`'s: the first touch of a pending tensor (a weight, its
`.grad`, its optimizer state) brings it up to date, whoever touches it, so ordinary callbacks and
module hooks cost a schedule nothing. At the epoch-level hooks (epoch start and end,
validation/test/predict start, end of training) everything pending is applied before the first
callback runs anyway: once per epoch it costs nothing measurable, and it covers what a touch
cannot see (a C++ extension reading a raw pointer, another thread) at the moments such code
usually runs (pruning, weight averaging, evaluation).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl


class FlushPoints(pl.Callback):
    """First in `trainer.callbacks` (the strategy puts it there and takes it out): runs before every
    other callback and the module's hook at the loop's epoch-level points."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def _always(self, *args: Any, **kwargs: Any) -> None:
        self._flush()

    on_train_epoch_start = on_train_epoch_end = _always
    on_validation_start = on_test_start = on_predict_start = _always
    on_train_end = on_fit_end = _always

    @staticmethod
    def install(trainer: "pl.Trainer", callback: Optional["FlushPoints"]) -> None:
        """Put `callback` first (None: remove it)."""
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, FlushPoints)]
        if callback is not None:
            trainer.callbacks.insert(0, callback)
