"""A deft run from the Python API, as a user calls it: logging left alone ("plain") or configured at
INFO ("info"); the Preserver left at its default ("default") or turned off ("off"). Communication
is forced to cost three times compute (a timings file), so the unguarded plan delays. Rank 0 prints
the run's DeFT report as JSON on its last stdout line; the test reads what commsched said on stderr."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import lightning.pytorch as pl

import commsched
from toy import ToyNet


def main() -> None:
    logging_setup, out, guard = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if logging_setup == "info":
        logging.basicConfig(level=logging.INFO)
    out.mkdir(parents=True, exist_ok=True)
    timings = out / "timings.json"
    timings.write_text(json.dumps({"forward": 1.0, "backward": [1.0], "costs": [[3.0], [4.0]]}))  # one bucket
    pl.seed_everything(0, verbose=False)
    deft = commsched.DeFTOptions(
        warmup_steps=2, measure_steps=2, cost_repeats=1, capacity=0.25, timings_file=str(timings)
    )
    strategy = commsched.DeFTStrategy(deft=deft, preserver=commsched.PreserverOptions(enabled=guard == "default"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(ToyNet())
    if trainer.is_global_zero:
        print(json.dumps(trainer.strategy.last_schedule.report()))


if __name__ == "__main__":
    main()
