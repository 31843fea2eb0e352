"""Stopped at step k and resumed == never stopped, for every schedule, with the project's data modules
(resumable in the middle of an epoch).

Usage: python run_resume.py OUT_DIR SCHEDULE [SCHEDULE ...]
Per schedule, stopped mid-epoch (step 4 of 6) and at an epoch's end (step 6), resumed to step 9,
and a run of 9 steps; rank 0 writes OUT_DIR/<schedule>-<how>.pt with the final weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import commsched
from commsched.cli.quiet import quiet_lightning
from commsched.data import SyntheticImageData
from commsched.models import ImageClassifier


def fit(out: Path, schedule: str, name: str, steps: int, resume: str | None = None) -> None:
    pl.seed_everything(3, verbose=False)
    model = ImageClassifier("resnet18", num_classes=10, width=4)
    data = SyntheticImageData(batch_size=16, train_size=192, val_size=32)  # 6 steps per epoch on 2 ranks
    strategy = DDPStrategy() if schedule == "ddp" else commsched.STRATEGIES[schedule](bucket_cap_mb=0.05)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=out / name, save_last=True, save_top_k=0)],
        default_root_dir=out / f"{name}-run",
    )
    trainer.fit(model, datamodule=data, ckpt_path=str(out / resume / "last.ckpt") if resume else None)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}.pt")


def main() -> None:
    out, schedules = Path(sys.argv[1]), sys.argv[2:]
    quiet_lightning()
    for schedule in schedules:
        fit(out, schedule, f"{schedule}-whole", 9)
        for stop in (4, 6):
            fit(out, schedule, f"{schedule}-first{stop}", stop)
            fit(out, schedule, f"{schedule}-resumed{stop}", 9, resume=f"{schedule}-first{stop}")


if __name__ == "__main__":
    main()
