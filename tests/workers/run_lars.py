"""wfbp runs with commsched.optim.LARS, its norms computed whole on every rank or in parallel.

Usage: python run_lars.py OUT_DIR    (2 processes; writes OUT_DIR/<case>.rank<r>.pt)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

import commsched
from commsched.optim import LARS
from run_deft import MLP, SEED

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class LARSModel(MLP):
    def __init__(self, parallel: bool) -> None:
        super().__init__("sgd")
        self.parallel = parallel

    def configure_optimizers(self):
        return LARS(
            self.parameters(),
            lr=0.5,
            momentum=0.9,
            weight_decay=1e-4,
            trust_coefficient=0.02,
            parallel_norms=self.parallel,
        )


def fit(out: Path, name: str) -> None:
    pl.seed_everything(SEED, verbose=False)
    model = LARSModel(parallel=name != "whole")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    schedule = "dear" if name == "refused-dear" else "wfbp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=commsched.STRATEGIES[schedule](),
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out / f"{name}-run",
    )
    try:
        trainer.fit(model)
    except commsched.CommSchedConfigError as error:
        torch.save({"refused": str(error)}, out / f"{name}.rank{trainer.global_rank}.pt")
        return
    torch.save(
        {
            "initial": initial,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "norm_collectives": trainer.optimizers[0].norm_exchanges,
        },
        out / f"{name}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in ("whole", "parallel", "refused-dear"):
        fit(out_dir, case)
