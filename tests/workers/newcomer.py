"""A newcomer's own script: their LightningModule, a Trainer at its defaults (logger, checkpoints,
progress bar), one strategy name after another in the same worker processes.

Usage: python newcomer.py DEVICES STRATEGY [STRATEGY ...]   (run in an empty directory)

Rank 0 writes final-<strategy>.pt (the trained weights) in the working directory; everything else
a run writes must land in the logger's folder (lightning_logs/version_N).
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers the strategies)

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class MyClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(4)
        )
        self.head = nn.Linear(8 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


QUIET = ("dear-quiet",)
"""Fits with no logger and no checkpoints: Lightning writes nothing, and neither may commsched."""


def strategy_for(name: str):
    """A registered name, or "dear-planned": DeAR with buckets planned from the run's first steps (it
    writes a plan and a profile), or "dear-quiet": the same in a quiet fit (`QUIET`)."""
    if name in ("dear-planned", "dear-quiet"):
        return commsched.DeARStrategy(
            fusion=commsched.FusionOptions(policy="dear-model", profile_steps=2, profile_warmup_steps=1)
        )
    return name


def main() -> None:
    devices, strategies = int(sys.argv[1]), sys.argv[2:]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(96, 1, 12, 12, generator=generator), torch.randint(0, 10, (96,), generator=generator)
    )
    for strategy in strategies:
        pl.seed_everything(7, verbose=False)
        model = MyClassifier()
        quiet = {"logger": False, "enable_checkpointing": False} if strategy in QUIET else {}
        trainer = pl.Trainer(
            strategy=strategy_for(strategy),
            accelerator="cpu",
            devices=devices,
            max_epochs=2,
            enable_progress_bar=False,
            **quiet,
        )
        trainer.fit(model, DataLoader(data, batch_size=8))
        if trainer.is_global_zero:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"final-{strategy}.pt")


if __name__ == "__main__":
    main()
