"""StepTimer: wall time per optimizer step, measured on rank 0 between consecutive batch starts."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl


class StepTimer(pl.Callback):
    """Records step durations after `warmup` steps; `median` is what benchmarks report."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self.durations: list[float] = []
        self._last: float | None = None
        self._seen = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last is not None and self._seen > self.warmup:
            self.durations.append(now - self._last)
        self._last = now
        self._seen += 1

    @property
    def median(self) -> float:
        if not self.durations:
            raise RuntimeError("StepTimer: no steps after warm-up were timed; run more steps")
        return statistics.median(self.durations)
