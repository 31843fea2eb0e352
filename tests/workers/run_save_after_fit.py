"""A checkpoint saved by hand after `fit` returns (`trainer.save_checkpoint`, as Lightning's docs show
it) against ModelCheckpoint's save of the same run at the same step, for test_checkpoints.py.

Usage: python run_save_after_fit.py OUT_DIR CASE [CASE ...]   (CASE: topk, streams)

Writes OUT_DIR/<case>/manual.ckpt and OUT_DIR/<case>/ckpt/last.ckpt.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import commsched

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402

warnings.filterwarnings("ignore")
STEPS = 8
CASES = {
    "topk": lambda: commsched.WFBPStrategy(
        bucket_cap_mb=600 / 2**20, compression=commsched.CompressionOptions(method="topk", density=0.1)
    ),
    "streams": lambda: commsched.WFBPStrategy(
        bucket_cap_mb=600 / 2**20,
        streams=commsched.StreamOptions(count="auto", trial_steps=1, warmup_steps=1, confirm_rounds=1),
    ),
}


def main() -> None:
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        pl.seed_everything(5, verbose=False)
        model = ToyNet(batch_size=4, train_size=4 * 2 * STEPS)
        folder = out / case
        saves = ModelCheckpoint(dirpath=folder / "ckpt", save_last=True, every_n_train_steps=STEPS)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=CASES[case](),
            max_steps=STEPS,
            logger=False,
            callbacks=[saves],
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=folder,
        )
        trainer.fit(model)
        trainer.save_checkpoint(folder / "manual.ckpt")


if __name__ == "__main__":
    main()
