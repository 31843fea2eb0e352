"""Per-step metrics for the logger: samples/s, the communication the step could not hide, and the
bytes it sent on each link."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl


class StepMetrics(pl.Callback):
    """Logs `samples_per_s` (all ranks together) and, under a commsched strategy, `exposed_comm_ms`
    (time the training loop waited on communication in that step) and `wire_mb/<link>` (megabytes
    this rank sent on each link in that step). Keeps the series for the summary."""

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self.step_seconds: list[float] = []
        self.exposed_ms: list[float] = []
        self.wire_mb: list[float] = []  # all links together, per step
        self._started = 0.0
        self._comm_at_start = 0.0
        self._wire_at_start: dict[str, float] = {}

    @staticmethod
    def _comm_seconds(trainer: pl.Trainer) -> float | None:
        return getattr(trainer.strategy, "exposed_comm_seconds", None)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = time.perf_counter()
        self._comm_at_start = self._comm_seconds(trainer) or 0.0
        self._wire_at_start = dict(getattr(trainer.strategy, "wire_bytes", {}))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds = time.perf_counter() - self._started
        self.step_seconds.append(seconds)
        pl_module.log("samples_per_s", self.samples_per_step / seconds, on_step=True, on_epoch=False, prog_bar=True)
        comm = self._comm_seconds(trainer)
        if comm is not None:
            exposed = (comm - self._comm_at_start) * 1e3
            self.exposed_ms.append(exposed)
            pl_module.log("exposed_comm_ms", exposed, on_step=True, on_epoch=False)
        wire = getattr(trainer.strategy, "wire_bytes", {})
        if wire:
            sent = {name: (total - self._wire_at_start.get(name, 0.0)) / 1e6 for name, total in wire.items()}
            self.wire_mb.append(sum(sent.values()))
            for name, megabytes in sent.items():
                pl_module.log(f"wire_mb/{name}", megabytes, on_step=True, on_epoch=False)
