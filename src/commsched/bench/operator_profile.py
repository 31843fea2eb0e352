"""Where an entry's timed steps go, operator by operator: torch.profiler around the steps the bench
times, in a run of its own whose times are not counted (the profiler slows what it watches).

The bench's figures say how long a step takes; this says what in it took the time, on the host and,
on a GPU, on the device: a schedule slower than ddp shows here whether its extra time is waiting
(`cudaStreamSynchronize`, `cudaMemcpy`, a collective's `wait`), copying, or Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from torch.profiler import ProfilerActivity, profile

from commsched.timing import StepTimer

ROWS = 40


class OperatorProfile(pl.Callback):
    """Runs torch.profiler over the steps `timer` times (from its first timed step to the end of the fit)
    and, on rank 0, writes the operator tables to `out` (.txt) and the timeline beside it (.trace.json)."""

    def __init__(self, timer: StepTimer, out: Path) -> None:
        self.timer = timer
        self.out = out
        self._profile: Optional[profile] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._profile is None and self.timer.timing and not trainer.should_stop:
            cuda = pl_module.device.type == "cuda"
            self._profile = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self._profile.__enter__()
        elif self._profile is not None and trainer.should_stop:  # the timer has its steps: this batch is not one
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        if trainer.global_rank == 0:
            self.write(self._profile, len(self.timer.durations), pl_module.device.type == "cuda")
        self._profile = None

    def write(self, watched: profile, steps: int, cuda: bool) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        averages = watched.key_averages()
        tables = [f"{steps} timed steps, rank 0; times are totals over them\n", "by time on the host (self):"]
        tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=ROWS))
        if cuda:
            tables += [
                "by time on the device (self):",
                averages.table(sort_by="self_device_time_total", row_limit=ROWS),
            ]
        self.out.with_suffix(".txt").write_text("\n".join(tables))
        watched.export_chrome_trace(str(self.out.with_suffix(".trace.json")))
