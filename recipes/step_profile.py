"""Where one schedule's steady steps spend their CPU: rank 0 under cProfile over steps START..END of
the benchmark's small CNN (2 CPU processes, the unlimited loopback, nothing set but the strategy's
name), with the wall and CPU time per step.

    python recipes/step_profile.py dear 110 150      # also: ddp, wfbp, deft, topk

Prints the step times and the 25 functions with the most time of their own; the whole profile is
written to step_profile_<schedule>.pstats in a folder of its own (its path is printed); the run's
other files are removed."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

import commsched  # noqa: F401 - registers the strategies' names
from commsched.data import SyntheticImages
from commsched.models import SmallCNN


class ProfileSteps(pl.Callback):
    def __init__(self, schedule: str, start: int, end: int) -> None:
        self.schedule, self.start, self.end = schedule, start, end
        self.profile = cProfile.Profile()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.start and trainer.global_rank == 0:
            self.cpu, self.wall = time.process_time(), time.perf_counter()
            self.profile.enable()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.end or trainer.global_rank != 0:
            return
        self.profile.disable()
        steps = self.end - self.start
        wall, cpu = (time.perf_counter() - self.wall) / steps, (time.process_time() - self.cpu) / steps
        text = io.StringIO()
        stats = pstats.Stats(self.profile, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        path = Path(tempfile.mkdtemp(prefix="step_profile_")) / f"step_profile_{self.schedule}.pstats"
        stats.dump_stats(path)
        print(text.getvalue())
        print(f"{self.schedule}: {wall * 1e3:.1f} ms a step, CPU {cpu * 1e3:.1f} ms (under cProfile); profile: {path}")


def main() -> None:
    schedule = sys.argv[1] if len(sys.argv) > 1 else "dear"
    start, end = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (110, 150)
    pl.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory(prefix="step_profile_run_") as run_dir:  # the run's own files, removed after
        _fit(schedule, start, end, run_dir)


def _fit(schedule: str, start: int, end: int, run_dir: str) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=schedule,
        max_steps=end + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ProfileSteps(schedule, start, end)],
        default_root_dir=run_dir,
    )
    trainer.fit(SmallCNN(width=64), DataLoader(SyntheticImages(32 * 2 * (end + 5)), batch_size=32))


if __name__ == "__main__":
    main()
