"""The soak: a long 2-process run with random per-rank delays (at batch start, in the forward, in the
backward and before the optimizer step), every replica's weights checksummed every 100 steps.

Usage: python run_soak.py SCHEDULE STEPS OUT_DIR   (SCHEDULE: dear, streams (WFBP on 4 streams), ddp)

Each rank writes OUT_DIR/<schedule>.rank<r>.pt: {"sums": {step: sha256 of every parameter's bytes},
"final": state_dict, "steps": global_step}. No collective is added for the check: the test compares
the ranks' files.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

import commsched

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402

EVERY = 100
MAX_DELAY_S = 0.003


BUCKET_MB = 600 / 2**20  # several buckets, each several units on 4 streams: every pending path is taken


def strategy_for(schedule: str):
    if schedule == "dear":
        return commsched.DeARStrategy(bucket_cap_mb=BUCKET_MB, dear=commsched.DeAROptions(fallback="never"))
    if schedule == "streams":
        return commsched.WFBPStrategy(
            bucket_cap_mb=BUCKET_MB, streams=commsched.StreamOptions(count=4, unit_mb=160 / 2**20)
        )
    return DDPStrategy(find_unused_parameters=True)


def checksum(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class RandomDelays(pl.Callback):
    """Sleeps a random time, different on every rank, at four points of every step; checksums the
    weights every `EVERY` steps (reading them applies any update still pending, as any reader does)."""

    def __init__(self, rank: int) -> None:
        self.rng = random.Random(1000 + rank)
        self.sums: dict[int, str] = {}

    def _sleep(self, *_: object) -> None:
        time.sleep(self.rng.uniform(0, MAX_DELAY_S))

    def on_fit_start(self, trainer, pl_module):
        pl_module.fc.register_forward_pre_hook(self._sleep)
        pl_module.fc.weight.register_hook(self._sleep)
        trainer.optimizers[0].register_step_pre_hook(self._sleep)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sleep()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % EVERY == 0:
            self.sums[trainer.global_step] = checksum(pl_module)


def main() -> None:
    schedule, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    pl.seed_everything(0, verbose=False)
    delays = RandomDelays(int(os.environ.get("LOCAL_RANK", "0")))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_for(schedule),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[delays],
        default_root_dir=out,
    )
    model = ToyNet(train_size=400)
    started = time.perf_counter()
    trainer.fit(model)
    elapsed = time.perf_counter() - started
    torch.save(
        {
            "sums": delays.sums,
            "steps": trainer.global_step,
            "seconds": elapsed,
            "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        },
        out / f"{schedule}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
