"""The kill matrix: a 2-process run of one schedule whose rank 1 dies at a chosen point of step 3; the
test reads rank 0's exit status and output, and the checkpoints it left.

Usage: python run_kill.py SCHEDULE POINT OUT_DIR
  SCHEDULE: wfbp, dear, deft, topk, streams, ddp (the reference: Lightning's own)
  POINT: batch-start, mid-backward, mid-step, mid-checkpoint (rank 1 dies there at step 3; the
         checkpoint at step 4 for mid-checkpoint), none (no one dies), resume (no one dies; the fit
         resumes from OUT_DIR/checkpoints/step2.ckpt)

Checkpoints go to OUT_DIR/checkpoints every 2 steps (step2.ckpt, step4.ckpt, ...); the final weights
of an uninterrupted or resumed run to OUT_DIR/final.pt. At exit, rank 0 prints the commsched issuer
threads still alive.
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import commsched

sys.path.insert(0, str(Path(__file__).parent))
from exit_report import report_issuer_threads, watch_workers_slowly  # noqa: E402
from toy import ToyNet  # noqa: E402

STEPS, DIES_AT = 6, 3
TIMEOUT = timedelta(seconds=15)
watch_workers_slowly()


def strategy_for(schedule: str):
    if schedule == "ddp":  # the toy model's branch is unused on some steps
        return DDPStrategy(find_unused_parameters=True)
    if schedule == "wfbp":
        return commsched.WFBPStrategy(timeout=TIMEOUT)
    if schedule == "dear":  # DeAR itself, not WFBP's turns
        return commsched.DeARStrategy(timeout=TIMEOUT, dear=commsched.DeAROptions(fallback="never"))
    if schedule == "deft":
        return commsched.DeFTStrategy(timeout=TIMEOUT)
    if schedule == "topk":  # sparse: residuals to carry across the resume
        return commsched.WFBPStrategy(
            timeout=TIMEOUT, compression=commsched.CompressionOptions(method="topk", density=0.1)
        )
    if schedule == "streams":
        return commsched.WFBPStrategy(timeout=TIMEOUT, streams=commsched.StreamOptions(count=4))
    raise ValueError(schedule)


class Dies(pl.Callback):
    """Rank 1 leaves with `os._exit(17)` (no cleanup, as a killed process) at `point` of step 3."""

    def __init__(self, point: str) -> None:
        self.point = point

    def _die(self, *_: object) -> None:
        os._exit(17)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != DIES_AT:
            return
        if self.point == "batch-start":
            self._die()
        elif self.point == "mid-backward":  # a middle layer's gradient: some buckets are on their way, others not
            pl_module.fc.weight.register_hook(self._die)
        elif self.point == "mid-step":
            trainer.optimizers[0].register_step_pre_hook(self._die)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.point == "mid-checkpoint" and trainer.global_step == DIES_AT + 1:
            self._die()


def main() -> None:
    schedule, point, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    atexit.register(report_issuer_threads)
    pl.seed_everything(0, verbose=False)
    saving = ModelCheckpoint(
        dirpath=out / "checkpoints",
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=2,
        save_top_k=-1,
    )
    callbacks = [saving] + (
        [Dies(point)] if os.environ.get("LOCAL_RANK") == "1" and point not in ("none", "resume") else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_for(schedule),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=out,
    )
    model = ToyNet(train_size=16)  # two steps an epoch: every checkpoint is at an epoch's end
    trainer.fit(model, ckpt_path=out / "checkpoints" / "step2.ckpt" if point == "resume" else None)
    if point in ("none", "resume") and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final.pt")
    elif point not in ("none", "resume"):
        print("commsched-test: training finished without the expected failure", flush=True)


if __name__ == "__main__":
    main()
