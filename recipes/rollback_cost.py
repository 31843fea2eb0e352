"""What DeAR's rollback copies cost (`DeAROptions(rollback=True)`, the default, against False): the
median step and the copies' peak size, the two settings interleaved over rounds, on the bench's small
CNN (3 M parameters, SGD with momentum). Run it where DeAR overlaps its all-gathers with the next
forward, which is where copies are taken, e.g. two emulated nodes at 600 Mbit (needs root):

    .venv/bin/commsched-cluster --nodes 2 --rate 600mbit -- .venv/bin/python recipes/rollback_cost.py [STEPS] [ROUNDS]

Rank 0 prints one Markdown row per setting: the best round's median ms/step and the copies' peak MB.
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
from torch.utils.data import DataLoader

import commsched
from commsched.bench.models import BENCH_MODELS
from commsched.timing import StepTimer

warnings.filterwarnings("ignore")
BATCH = 32


def timed(rollback: bool, steps: int, nodes: int) -> tuple[float, int]:
    pl.seed_everything(0, verbose=False)
    model, make_data = BENCH_MODELS["small_cnn"](64)
    timer = StepTimer(warmup=3, stop_after=steps)
    strategy = commsched.DeARStrategy(bucket_cap_mb=2, dear=commsched.DeAROptions(fallback="never", rollback=rollback))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        num_nodes=nodes,
        max_steps=steps + 50,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        default_root_dir=f"outputs/rollback_cost/{rollback}",
    )
    trainer.fit(model, DataLoader(make_data(BATCH * nodes * (steps + 52)), batch_size=BATCH))
    return timer.median, strategy.last_schedule.deferred.rollback_peak_bytes


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    nodes = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    best: dict[bool, float] = {}
    peak: dict[bool, int] = {}
    for _ in range(rounds):
        for rollback in (True, False):
            seconds, copied = timed(rollback, steps, nodes)
            best[rollback] = min(seconds, best.get(rollback, float("inf")))
            peak[rollback] = max(copied, peak.get(rollback, 0))
    if pl.utilities.rank_zero_only.rank == 0:
        print("| DeAROptions | ms/step (best of rounds) | against rollback=False | copies' peak |")
        print("|---|---|---|---|")
        for rollback in (True, False):
            print(
                f"| rollback={rollback} | {best[rollback] * 1e3:.1f} | {best[False] / best[rollback]:.3f}x | "
                f"{peak[rollback] / 2**20:.1f} MB |"
            )


if __name__ == "__main__":
    main()
