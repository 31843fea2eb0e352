"""Start a 2-process run that must fail with a clear error; the test reads the exit code and output.

Usage: python run_failure.py MODE OUT_DIR   (MODE: manual, lbfgs, plan-mismatch, peer-dies, peer-hangs,
peer-dies-saved: with Lightning's OnExceptionCheckpoint saving into OUT_DIR, the run's folder)
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

import commsched
import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from toy import ManualToyNet, ToyNet  # noqa: E402


class DiesAtStep3(ToyNet):
    """Rank 1 leaves at step 3: killed outright ('dies') or stuck forever ('hangs')."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            if self.how == "dies":
                os._exit(17)
            time.sleep(3600)


def model_for(mode: str) -> pl.LightningModule:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if mode == "manual":
        return ManualToyNet()
    if mode == "lbfgs":
        return ToyNet(optimizer="lbfgs")
    if mode == "plan-mismatch":
        model = ToyNet()
        if rank == 1:
            model.extra = torch.nn.Linear(2, 2)  # a parameter rank 0 does not have
        return model
    return DiesAtStep3(mode.removeprefix("peer-").removesuffix("-saved"))


def report_issuer_threads() -> None:
    alive = [t.name for t in threading.enumerate() if t.name.startswith("commsched-issue") and t.is_alive()]
    print(f"commsched-test: rank {os.environ.get('LOCAL_RANK', '0')} issuer threads alive at exit: {alive}", flush=True)


def main() -> None:
    mode = sys.argv[1]
    atexit.register(report_issuer_threads)
    pl.seed_everything(0, verbose=False)
    strategy = commsched.DeARStrategy(timeout=timedelta(seconds=15))
    callbacks = [OnExceptionCheckpoint(dirpath=sys.argv[2])] if mode.endswith("-saved") else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=20, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
        default_root_dir=sys.argv[2],
    )
    trainer.fit(model_for(mode))
    print("commsched-test: training finished without the expected error")


if __name__ == "__main__":
    main()
