"""What watching pending tensors (`commsched.schedules.pending_tensors`) costs dear per step, on a model
of many small ops.

    .venv/bin/python recipes/detection_cost.py [MODEL] [ROUNDS] [STEPS]      # default: gpt2_tiny 4 40

Two CPU workers train MODEL under dear twice per round, interleaved: as shipped, and with the watch
switched off (its `mark` made a no-op: nothing is ever pending, so nothing is brought up to date
early -- unsafe for real training, which is why it is only done here). Every run starts from the
same seed and sees the same batches; a clock-reading callback is in the Trainer, as in a real
project. Prints each variant's median step, the cost of the watch in ms and in % of the step, and
how many touches and marked tensors a step had.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

import commsched
from commsched.bench.models import BENCH_MODELS
from commsched.cli.quiet import quiet_lightning
from commsched.schedules.pending_tensors import PendingTensors
from commsched.timing import StepTimer

WARMUP = 5


class ReadsClock(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        self.last = time.perf_counter()


def run(model_name: str, steps: int, watched: bool) -> tuple[float, dict]:
    pl.seed_everything(0, verbose=False)
    model, make_data = BENCH_MODELS[model_name](64)
    original = PendingTensors.mark
    if not watched:
        PendingTensors.mark = lambda self, key, tensors, kind: None  # type: ignore[method-assign]
    try:
        timer = StepTimer(warmup=WARMUP)
        strategy = commsched.DeARStrategy(bucket_cap_mb=2)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=steps + WARMUP + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer, ReadsClock()],
        )
        trainer.fit(model, DataLoader(make_data(8 * 2 * (steps + WARMUP + 2)), batch_size=8))
    finally:
        PendingTensors.mark = original  # type: ignore[method-assign]
    schedule = strategy.last_schedule
    counts = {
        "touches": schedule.deferred.pending.touches,
        "rank": trainer.global_rank,
        "tensors": sum(len(b.params) for b in schedule.plan.buckets),
    }
    return timer.median, counts


def main() -> None:
    model_name = sys.argv[1] if len(sys.argv) > 1 else "gpt2_tiny"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    quiet_lightning()
    times: dict[bool, list[float]] = {True: [], False: []}
    counts: dict = {}
    for _ in range(rounds):
        for watched in (True, False):
            step, counts[watched] = run(model_name, steps, watched)
            times[watched].append(step)
    if counts[True]["rank"] != 0:
        return
    on, off = statistics.median(times[True]), statistics.median(times[False])
    paired = statistics.median(a / b - 1 for a, b in zip(times[True], times[False]))
    print(
        f"{model_name}, dear, 2 workers, {rounds} rounds x {steps} steps, {counts[True]['tensors']} parameters: "
        f"watched {on * 1e3:.2f} ms/step, unwatched {off * 1e3:.2f} ms/step; the watch costs "
        f"{(on - off) * 1e3:+.2f} ms ({on / off - 1:+.1%}; round by round, median {paired:+.1%}); "
        f"touches in the whole run: {counts[True]['touches']}"
    )


if __name__ == "__main__":
    main()
