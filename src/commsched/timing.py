"""StepTimer: wall time, CPU time and bytes sent per optimizer step, between consecutive batch starts."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl

from commsched.comm.device_time import StreamMarks


class StepTimer(pl.Callback):
    """Records step durations after `warmup` steps, counted from when the strategy has made its
    automatic choices (`settled`: the buckets, a stream search, sparse or dense; Lightning's own
    strategies are settled from the start); `median` is what benchmarks report. With `stop_after`,
    the fit stops once that many steps were timed (every rank at the same step: they settle together).

    CPU time is this process's, all threads included (the backend's communication threads too):
    on a machine with few cores, CPU spent on communication is compute time lost. On a GPU a step's
    duration is read on the model's stream (`StreamMarks`: when the stream reached each batch start),
    a completion time rather than how far ahead of the GPU the host has queued, without holding the
    host back."""

    def __init__(self, warmup: int = 3, stop_after: int = 0) -> None:
        self.warmup = warmup
        self.stop_after = stop_after
        self.deciding_steps = 0
        """Steps the strategy took to make its choices (not timed)."""
        self._steps = StreamMarks()
        self.cpu: list[float] = []
        self.wire_bytes: list[float] = []
        """Per timed step, the bytes this rank sent on all of a commsched strategy's links."""
        self.local_bytes: list[float] = []
        """Per timed step, the part of `wire_bytes` sent on node-local links (a two-level exchange's
        "intra" links): the rest may cross nodes."""
        self._last: tuple[Any, float, float, float] | None = None
        self._seen = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        wire = getattr(trainer.strategy, "wire_bytes", None)  # None: not a commsched strategy
        now = (
            StreamMarks.mark(pl_module.device),
            time.process_time(),
            sum(wire.values()) if wire is not None else float("nan"),
            sum(sent for name, sent in wire.items() if name.startswith("intra")) if wire is not None else float("nan"),
        )
        if not getattr(trainer.strategy, "settled", True):
            self.deciding_steps += 1
            self._seen, self._last = 0, None
            return
        if self._last is not None and self._seen > self.warmup:
            self._steps.add(self._last[0], now[0])
            self.cpu.append(now[1] - self._last[1])
            if wire is not None:
                self.wire_bytes.append(now[2] - self._last[2])
                self.local_bytes.append(now[3] - self._last[3])
        self._last = now
        self._seen += 1
        if self.stop_after and len(self._steps) >= self.stop_after:
            trainer.should_stop = True

    @property
    def timing(self) -> bool:
        """The step under way is one this timer times (read in a callback after the timer's own batch start)."""
        return self._last is not None and self._seen > self.warmup

    @property
    def durations(self) -> list[float]:
        """Seconds of each timed step."""
        return self._steps.seconds()

    @property
    def median(self) -> float:
        durations = self.durations
        if not durations:
            raise RuntimeError("StepTimer: no steps after warm-up were timed; run more steps")
        return statistics.median(durations)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu) if self.cpu else float("nan")

    @property
    def median_wire_bytes(self) -> float:
        return statistics.median(self.wire_bytes) if self.wire_bytes else float("nan")

    @property
    def median_local_bytes(self) -> float:
        return statistics.median(self.local_bytes) if self.local_bytes else float("nan")
