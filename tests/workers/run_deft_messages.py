"""A deft run from the Python API, logging left as the user left it ("plain") or configured by the
user at INFO ("info"): prints nothing itself; the test reads what commsched said on stderr."""

from __future__ import annotations

import logging
import sys

import lightning.pytorch as pl

import commsched
from toy import ToyNet


def main() -> None:
    if sys.argv[1] == "info":
        logging.basicConfig(level=logging.INFO)
    pl.seed_everything(0, verbose=False)
    strategy = commsched.DeFTStrategy(deft=commsched.DeFTOptions(warmup_steps=2, measure_steps=2, cost_repeats=1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=sys.argv[2])
    trainer.fit(ToyNet())


if __name__ == "__main__":
    main()
